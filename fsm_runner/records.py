"""The journal's records, as attrs classes, and the converter that moves them in and out of it.

Records are frozen: a handler sees a snapshot of its run that it cannot change behind the
engine's back. Timestamps are aware UTC datetimes; JSON payloads are plain Python data.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from fsm_runner._convert import by_value, converter, format_utc, parse_utc
from fsm_runner.spec import RunLifecycle

__all__ = [
    "ITERATION_FIELDS",
    "ArtifactRecord",
    "EffectRecord",
    "EffectStatus",
    "ErrorType",
    "IterationRecord",
    "RunRecord",
    "SignalRecord",
    "SignalStatus",
    "TransitionRecord",
    "converter",
    "format_utc",
    "parse_utc",
    "positional_builder",
    "structure",
    "unstructure",
    "utc_now",
]

T = TypeVar("T")
A = TypeVar("A", bound=attrs.AttrsInstance)


def utc_now() -> dt.datetime:
    """The current time as an aware UTC datetime."""
    return dt.datetime.now(dt.timezone.utc)


@attrs.frozen
class RunRecord:
    """One run, as its row in the journal stands: a projection of its last transition.

    Attributes:
        run_id: the run's id.
        machine: the machine's name.
        spec_hash: hash of the spec the run started with.
        state: the state the run is in (the ``to_state`` of its last transition).
        status: ``active`` until the run ends, then how it ended.
        seq: seq of the run's last transition (0 right after start).
        iteration: the current iteration (0 until a ``starts_iteration`` state is entered).
        attempt: the attempt of the current visit to ``state`` (1-based).
        input: the JSON input the run was started with.
        context: the run's JSON context, updated by phase results.
        error: the last phase error (type, message, traceback), if the last phase failed.
        created_at: when the run started.
        updated_at: when the run row was last written.
        parent_run_id: the run that started this one, if any.
        forked_from: ``RUN@SEQ`` this run was forked from, if any.
        abort_reason: set when an abort was requested and not yet carried out.
        lease_owner: the worker holding the run's lease, if any.
        lease_expires_at: when that lease expires.
        lease_token: increases on every claim; commits are fenced by it.
        return_to: where a :data:`fsm_runner.spec.RETURN` transition takes the run (the state
            it left for the state it is in now), if it can take one.
        return_attempt: the attempt ``return_to`` was on when the run left it.
        visit_seq: the seq of the transition that began the current visit of ``state``
            (retries, interruptions and returns continue a visit); effects are keyed by it.
        return_visit: the visit ``return_to`` was on when the run left it.
        recoveries: how often the run's lease was taken over after its worker was lost.
    """

    run_id: str
    machine: str
    spec_hash: str
    state: str
    status: RunLifecycle = RunLifecycle.ACTIVE
    seq: int = 0
    iteration: int = 0
    attempt: int = 1
    input: Any = None
    context: Mapping[str, Any] = attrs.field(factory=dict)
    error: Mapping[str, Any] | None = None
    created_at: dt.datetime = attrs.field(factory=utc_now)
    updated_at: dt.datetime = attrs.field(factory=utc_now)
    parent_run_id: str | None = None
    forked_from: str | None = None
    abort_reason: str | None = None
    lease_owner: str | None = None
    lease_expires_at: dt.datetime | None = None
    lease_token: int = 0
    return_to: str | None = None
    return_attempt: int = 0
    visit_seq: int = 0
    return_visit: int = 0
    recoveries: int = 0

    @property
    def ended(self) -> bool:
        """Whether the run has ended (it can no longer be advanced, only forked)."""
        return self.status is not RunLifecycle.ACTIVE


@attrs.frozen
class TransitionRecord:
    """One journaled state change of a run.

    Attributes:
        run_id: the run.
        seq: 0 for the start, then one more per transition, without gaps.
        from_state: the state left (``None`` for seq 0).
        event: the event that caused the change.
        to_state: the state entered.
        iteration: the run's iteration after the change.
        attempt: the attempt of the phase that produced the event.
        at: when it was committed.
        duration_ms: how long the phase that produced it took.
        result: the phase's output, context updates and error, as JSON.
        lease_token: the lease token of the worker that wrote it (fencing: a commit is refused
            unless it is the run's current token).
        digest: as read from a journal that keeps them (SQLite, PostgreSQL, memory), the
            transition's link in its run's hash chain: BLAKE2b-128 (hex) of the previous
            transition's digest and this one's content as stored (see the reference's journal
            schema); ``None`` as written by the engine, or read from a journal without
            digests. Not compared: two transitions are equal whatever their digests.
    """

    run_id: str
    seq: int
    from_state: str | None
    event: str
    to_state: str
    iteration: int = 0
    attempt: int = 1
    at: dt.datetime = attrs.field(factory=utc_now)
    duration_ms: float = 0.0
    result: Mapping[str, Any] | None = None
    lease_token: int = 0
    digest: str | None = attrs.field(default=None, eq=False)

    @property
    def output(self) -> Any:
        """The output of the phase that produced this transition."""
        return (self.result or {}).get("output")

    @property
    def error(self) -> Mapping[str, Any] | None:
        """The error of the phase that produced this transition, if it failed."""
        error = (self.result or {}).get("error")
        return error if isinstance(error, Mapping) else None


class ErrorType(str, enum.Enum):
    """How an iteration went wrong, if it did."""

    NONE = "none"
    AGENT_CRASH = "agent_crash"
    AGENT_FAILURE = "agent_failure"
    VERIFICATION_FAILED = "verification_failed"
    TIMEOUT = "timeout"
    SYSTEM_ERROR = "system_error"

    def __str__(self) -> str:
        return self.value


def _levels(value: Any) -> tuple[str, ...]:
    return tuple(value or ())


@attrs.frozen
class IterationRecord:
    """What happened in one iteration of a run (one pass through its ``starts_iteration`` state).

    The engine opens the record when the iteration starts and writes it in the same journal
    transaction as each transition that updates it (phases update it through
    ``PhaseResult(iteration={...})``). Records written before a field existed load with its
    default.

    Attributes:
        run_id: the run.
        iteration: the iteration's number (1-based).
        state: the state the run was in at the record's last update.
        started_at: when the iteration started.
        completed_at: when its last transition was committed.
        duration_ms: from start to last transition.
        snapshot_id: the workspace snapshot taken in this iteration.
        feedback: the feedback generated in this iteration, for the next build.
        feedback_fallback: whether that feedback is the fallback (its generator failed).
        agent_session_id: the agent session this iteration's build ran in.
        agent_result_ref: reference (artifact name) of the stored agent result.
        agent_duration_ms: how long the agent ran.
        success: whether the agent run succeeded.
        model: the model the agent used.
        tokens_input: tokens in.
        tokens_output: tokens out.
        tokens_total: tokens in all.
        cost_usd: what the agent run cost.
        verification_ref: reference (artifact name) of the stored verification report.
        passed: whether verification passed.
        levels_run: the verification levels run, e.g. ``("L0", "L1")``.
        verification_duration_ms: how long verification took.
        error_type: how the iteration went wrong, if it did.
        error_message: the error, in one line.
        error_details: structured details, e.g. the failed level and check.
        extra: fields of the host's own.
    """

    run_id: str
    iteration: int
    state: str = ""
    started_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None
    duration_ms: float | None = None
    snapshot_id: str | None = None
    feedback: str | None = None
    feedback_fallback: bool = False
    agent_session_id: str | None = None
    agent_result_ref: str | None = None
    agent_duration_ms: float | None = None
    success: bool | None = None
    model: str | None = None
    tokens_input: int | None = None
    tokens_output: int | None = None
    tokens_total: int | None = None
    cost_usd: float | None = None
    verification_ref: str | None = None
    passed: bool | None = None
    levels_run: tuple[str, ...] = attrs.field(default=(), converter=_levels)
    verification_duration_ms: float | None = None
    error_type: ErrorType = attrs.field(default=ErrorType.NONE, converter=ErrorType)
    error_message: str | None = None
    error_details: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = attrs.field(factory=dict)


#: The fields a phase may update through ``PhaseResult(iteration={...})``.
ITERATION_FIELDS: frozenset[str] = frozenset(
    field.name
    for field in attrs.fields(IterationRecord)
    if field.name not in ("run_id", "iteration", "started_at", "completed_at", "duration_ms")
)


@attrs.frozen
class ArtifactRecord:
    """Something a phase produced and kept: an agent result, a verification report, a file.

    Handlers return artifacts in ``PhaseResult(artifacts=[...])``; the engine journals them in
    the same transaction as the phase's transition. An artifact whose storage failed is
    recorded too, with ``status="failed"`` and the error — a failed write never fails a phase.

    Attributes:
        name: the artifact's name, unique within its run (e.g. ``agent-2``).
        kind: what it is (``agent_result``, ``verification_report``, …).
        content: its JSON content, kept in the journal.
        path: where a copy was written, if anywhere.
        sha256: the SHA-256 of that copy.
        size: its size in bytes.
        status: ``stored`` or ``failed``.
        error: why storing it failed.
        run_id: the run (set by the engine).
        seq: the transition it was committed with (set by the engine).
        iteration: the run's iteration then (set by the engine).
        created_at: when it was committed (set by the engine).
    """

    name: str
    kind: str = "artifact"
    content: Any = None
    path: str | None = None
    sha256: str | None = None
    size: int | None = None
    status: str = "stored"
    error: str | None = None
    run_id: str = ""
    seq: int = 0
    iteration: int = 0
    created_at: dt.datetime | None = None


class EffectStatus(str, enum.Enum):
    """Where a recorded side effect stands."""

    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class EffectRecord:
    """One external side effect of a phase, recorded before it happens.

    Attributes:
        run_id: the run.
        visit_seq: the visit of the state it belongs to (``RunRecord.visit_seq``).
        name: unique within the visit.
        state: the state whose phase performed it.
        kind: the operation kind (``read``, ``mutate``, ``topic_peek``, ``topic_publish`` …).
        params: its parameters, as JSON.
        idempotency_key: given by the handler, or derived from run, visit, name and params.
        status: ``in_flight`` (recorded, not known to have finished), ``done`` or ``failed``.
        result: what it returned, once done.
        error: type and message, if it failed.
        idempotent: whether it may be called again after a crash caught it in flight.
        started_at: when it was recorded in flight.
        completed_at: when its outcome was recorded.
    """

    run_id: str
    visit_seq: int
    name: str
    state: str
    kind: str
    params: Any = None
    idempotency_key: str = ""
    status: EffectStatus = attrs.field(default=EffectStatus.IN_FLIGHT, converter=EffectStatus)
    result: Any = None
    error: Mapping[str, Any] | None = None
    idempotent: bool = False
    started_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None


class SignalStatus(str, enum.Enum):
    """Where a signal sent to a run stands."""

    #: Journaled, not consumed yet: the run consumes it when it waits in a state accepting it.
    PENDING = "pending"
    #: A transition of the run consumed it (``SignalRecord.consumed_seq``).
    CONSUMED = "consumed"
    #: The run ended before it waited in a state accepting it. (Stored as pending: a journal
    #: reports a pending signal of an ended run as expired.)
    EXPIRED = "expired"

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class SignalRecord:
    """A signal sent to a run (``Engine.signal``): its mailbox entry, kept after consumption.

    Attributes:
        run_id: the run.
        number: its place in the journal's arrival order (increasing, unique per journal);
            a run consumes its signals in this order.
        name: the signal's name: the event the waiting state's exit takes.
        payload: the JSON it carries; the consuming transition's output.
        signal_id: the sender's idempotency key, unique per run; a signal repeated with it
            is not journaled again.
        received_at: when it was journaled.
        status: ``pending``, ``consumed``, or ``expired`` (the run ended first).
        consumed_seq: the seq of the transition that consumed it.
        consumed_at: when that transition was committed.
    """

    run_id: str
    number: int
    name: str
    payload: Any = None
    signal_id: str | None = None
    received_at: dt.datetime = attrs.field(factory=utc_now)
    status: SignalStatus = attrs.field(default=SignalStatus.PENDING, converter=SignalStatus)
    consumed_seq: int | None = None
    consumed_at: dt.datetime | None = None


_DEFAULTED: dict[type, frozenset[str]] = {}


def _defaulted(cls: Any) -> frozenset[str]:
    names = _DEFAULTED.get(cls)
    if names is None:
        fields = attrs.fields(cls)
        names = _DEFAULTED[cls] = frozenset(
            f.name for f in fields if f.default is not attrs.NOTHING
        )
    return names


def positional_builder(cls: type[A]) -> Callable[..., A]:
    """A fast constructor of the frozen, slotted attrs class ``cls``: every field, in order.

    For the engine's hot path. ``cls(...)`` of a frozen class sets each field through
    ``object.__setattr__``, and calling each slot's ``__set__`` still costs ~45 ns a field. The
    builder fills a bare instance of a private subclass that adds no slots and keeps Python's
    plain ``__setattr__`` (so each field is one specialised slot store, ~10 ns), then makes it
    a ``cls`` by ``__class__`` assignment, which Python allows between classes of one layout:
    what comes out is exactly what ``cls(...)`` builds, frozen, about 3x faster for a 24-field
    record. It applies no defaults, so callers pass every field — but for the fields that are
    not compared (``eq=False``) and default to ``None`` (a transition's ``digest``), which
    may be left out; a class with converters or validators is refused (the builder would skip
    them).

    Raises:
        TypeError: ``cls`` has a field with a converter or validator, or no slots.
    """
    fields = attrs.fields(cls)
    if any(f.converter is not None or f.validator is not None for f in fields):
        raise TypeError(f"{cls.__qualname__} has converters or validators")
    for field in fields:
        slot = cls.__dict__.get(field.name)
        if slot is None or not hasattr(slot, "__set__"):
            raise TypeError(f"{cls.__qualname__}.{field.name} is not a slot")
    # Both hooks: with either still the frozen class's, every store goes through Python.
    unfrozen = type(
        f"_Unfrozen{cls.__name__}",
        (cls,),
        {"__slots__": (), "__setattr__": object.__setattr__, "__delattr__": object.__delattr__},
    )
    namespace: dict[str, Any] = {"new": object.__new__, "cls": cls, "unfrozen": unfrozen}
    optional = [not f.eq and f.default is None for f in fields]
    params = ", ".join(f"v{i}=None" if optional[i] else f"v{i}" for i in range(len(fields)))
    lines = [f"def build({params}):"]
    lines.append("    obj = new(unfrozen)")
    lines += [f"    obj.{field.name} = v{index}" for index, field in enumerate(fields)]
    lines += ["    obj.__class__ = cls", "    return obj"]
    code = compile("\n".join(lines), f"<positional builder of {cls.__qualname__}>", "exec")
    exec(code, namespace)  # noqa: S102 - our own generated source, as attrs does for __init__
    build: Callable[..., A] = namespace["build"]
    return build


def structure(data: Mapping[str, Any], cls: type[T]) -> T:
    """Build a record from journal data with the one converter.

    A ``NULL`` (``None``) in a field that has a default takes the default: journals written
    before a field existed load with its default.
    """
    defaulted = _defaulted(cls)
    return converter.structure(
        {k: v for k, v in data.items() if v is not None or k not in defaulted}, cls
    )


def unstructure(record: object) -> dict[str, Any]:
    """Turn a record into plain JSON-ready data (all fields, defaults included)."""
    data: dict[str, Any] = converter.unstructure(record)
    record_type: Any = type(record)
    for field in attrs.fields(record_type):
        if field.name not in data:
            value = getattr(record, field.name)
            if value is None and field.name == "digest":
                continue  # a transition as written, or read from a journal without digests
            data[field.name] = converter.unstructure(value)
    return data


by_value(ErrorType, EffectStatus)
