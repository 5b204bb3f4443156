"""The journal's records, as attrs classes, and the converter that moves them in and out of it.

Records are frozen: a handler sees a snapshot of its run that it cannot change behind the
engine's back. Timestamps are aware UTC datetimes; JSON payloads are plain Python data.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from fsm_runner._convert import converter, format_utc, parse_utc
from fsm_runner.spec import Outcome

__all__ = [
    "RunRecord",
    "TransitionRecord",
    "converter",
    "format_utc",
    "parse_utc",
    "structure",
    "unstructure",
    "utc_now",
]

T = TypeVar("T")


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
    """

    run_id: str
    machine: str
    spec_hash: str
    state: str
    status: Outcome = Outcome.ACTIVE
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

    @property
    def ended(self) -> bool:
        """Whether the run has ended (it can no longer be advanced, only forked)."""
        return self.status is not Outcome.ACTIVE


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

    @property
    def output(self) -> Any:
        """The output of the phase that produced this transition."""
        return (self.result or {}).get("output")

    @property
    def error(self) -> Mapping[str, Any] | None:
        """The error of the phase that produced this transition, if it failed."""
        error = (self.result or {}).get("error")
        return error if isinstance(error, Mapping) else None


_DEFAULTED: dict[type, frozenset[str]] = {}


def _defaulted(cls: Any) -> frozenset[str]:
    names = _DEFAULTED.get(cls)
    if names is None:
        fields = attrs.fields(cls)
        names = _DEFAULTED[cls] = frozenset(
            f.name for f in fields if f.default is not attrs.NOTHING
        )
    return names


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
            data[field.name] = converter.unstructure(value)
    return data
