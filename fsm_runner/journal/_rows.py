"""Records as rows: the parameters both SQL journals bind, each with its own way to store a time.

SQLite stores timestamps as fixed-width UTC text (:func:`fsm_runner.records.format_utc`);
PostgreSQL as ``timestamptz`` (aware datetimes). Everything else — which columns hold JSON, how
enums are written — is the same, and lives here once, with the checks every journal makes of
a fork's rows.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from fsm_runner._json import dumps_json
from fsm_runner.exceptions import JournalError
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    SignalRecord,
    SignalStatus,
    TransitionRecord,
    converter,
    parse_utc,
)

__all__ = [
    "ARTIFACT_COLUMNS",
    "EFFECT_COLUMNS",
    "ITERATION_COLUMNS",
    "ITERATION_JSON",
    "RUN_COLUMNS",
    "RUN_JSON",
    "RUN_TIMES",
    "SIGNAL_COLUMNS",
    "TRANSITION_COLUMNS",
    "Stamp",
    "artifact_params",
    "check_fork",
    "check_fork_source",
    "checked_spec_json",
    "decode_effect",
    "decode_iteration",
    "decode_signal",
    "dumps",
    "effect_params",
    "iteration_params",
    "run_params",
    "signal_params",
    "transition_params",
]

#: How a journal stores a time.
Stamp = Callable[[dt.datetime], Any]
#: How a journal reads a JSON column back (``None`` stays ``None``).
Loads = Callable[[Any], Any]

#: The run row's columns, in the order both journals insert them.
RUN_COLUMNS = (
    "run_id", "machine", "spec_hash", "state", "status", "seq", "iteration", "attempt", "input",
    "context", "error", "created_at", "updated_at", "parent_run_id", "forked_from",
    "abort_reason", "lease_owner", "lease_expires_at", "lease_token", "return_to",
    "return_attempt", "visit_seq", "return_visit", "recoveries",
)  # fmt: skip
#: A transition's columns, in the order of :func:`transition_params`.
TRANSITION_COLUMNS = (
    "run_id", "seq", "from_state", "event", "to_state", "iteration", "attempt", "at",
    "duration_ms", "result", "lease_token",
)  # fmt: skip
RUN_JSON = ("input", "context", "error")
RUN_TIMES = ("created_at", "updated_at", "lease_expires_at")
ITERATION_COLUMNS = tuple(field.name for field in attrs.fields(IterationRecord))
ITERATION_JSON = ("levels_run", "error_details", "extra")
ARTIFACT_COLUMNS = (
    "run_id", "name", "kind", "seq", "iteration", "status", "path", "sha256", "size", "error",
    "content", "created_at",
)  # fmt: skip
EFFECT_COLUMNS = tuple(field.name for field in attrs.fields(EffectRecord))
EFFECT_JSON = ("params", "result", "error")
_ITERATION_FLAGS = ("success", "passed", "feedback_fallback")
#: A signal's columns as read (:func:`decode_signal`), in the record's order.
SIGNAL_COLUMNS = (
    "run_id", "number", "name", "payload", "signal_id", "received_at", "consumed_seq",
    "consumed_at",
)  # fmt: skip


def dumps(value: Any) -> str | None:
    """Compact, standard JSON text of ``value`` (``None`` stays NULL).

    Raises:
        JournalError: the value is not JSON that every journal stores alike (not
            serialisable, NaN or Infinity, nested too deep, a lone surrogate: see
            :func:`fsm_runner._json.dumps_json`); nothing was written.
    """
    if value is None:
        return None
    if type(value) is dict and not value:
        return "{}"  # a run's context before its first phase
    try:
        return dumps_json(value)
    except ValueError as exc:
        raise JournalError(f"payload {exc}; nothing was written") from None


def _check_column(value: Any, column: str) -> None:
    """Refuse a plain column's value that SQLite and PostgreSQL would not store as given.

    Only floats and non-ASCII text are looked at (both O(1) otherwise): SQLite stores NaN as
    NULL, and neither database can hold a lone surrogate.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise JournalError(f"{column} is {value}, not a finite number; nothing was written")
    if isinstance(value, str) and not value.isascii():
        try:
            dumps_json(value)
        except ValueError as exc:
            raise JournalError(f"{column} {exc}; nothing was written") from None


def checked_spec_json(spec_hash: str, text: str, *, path: str | None) -> str:
    """``text``, the stored JSON of spec ``spec_hash``, once it is known to be that spec's.

    A spec's hash is the SHA-256 of its canonical JSON, and the journal stores exactly that
    text: JSON that no longer hashes to its key was damaged or edited by hand, and replaying,
    drawing or resuming a run through it would misread the run.

    Raises:
        JournalError: the text does not hash to ``spec_hash``.
    """
    if hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() != spec_hash:
        raise JournalError(
            f"holds spec {spec_hash[:12]} whose JSON does not match its hash"
            " (damaged or edited by hand); nothing was changed",
            path=path,
        )
    return text


def run_params(run: RunRecord, columns: Sequence[str], stamp: Stamp) -> tuple[Any, ...]:
    """The run row's values, in ``columns`` order."""
    getter, (json_at, status_at, times_at), plain = _run_reader(tuple(columns))
    values = list(getter(run))
    for at in json_at:
        values[at] = dumps(values[at])
    for at in status_at:
        values[at] = values[at].value
    stamped: Any = None
    text: Any = None
    for at in times_at:
        value = values[at]
        if value is not None:
            if value is not stamped:  # a new run's created_at is its updated_at: once
                stamped, text = value, stamp(value)
            values[at] = text
    for at, column in plain:
        value = values[at]
        kind = value.__class__
        if kind is str:
            if not value.isascii():
                _check_column(value, column)
        elif kind is not int and value is not None:  # floats, str subclasses: checked as ever
            _check_column(value, column)
    return tuple(values)


_Reader = tuple[
    Callable[[RunRecord], tuple[Any, ...]],
    tuple[list[int], list[int], list[int]],
    list[tuple[int, str]],
]
_run_readers: dict[tuple[str, ...], _Reader] = {}


def _run_reader(columns: tuple[str, ...]) -> _Reader:
    """How :func:`run_params` reads ``columns``: one getter for all of them.

    Then, by position, the columns it converts (JSON, the status, times) and those it checks.
    """
    reader = _run_readers.get(columns)
    if reader is None:
        getter = operator.attrgetter(*columns)
        read = getter if len(columns) > 1 else lambda run: (getter(run),)
        converted = (
            [at for at, column in enumerate(columns) if column in RUN_JSON],
            [at for at, column in enumerate(columns) if column == "status"],
            [at for at, column in enumerate(columns) if column in RUN_TIMES],
        )
        plain = _plain_columns(columns)
        reader = _run_readers[columns] = (read, converted, plain)
    return reader


def _plain_columns(columns: Sequence[str]) -> list[tuple[int, str]]:
    """The columns :func:`run_params` stores as given (after checking them), by position."""
    return [
        (at, column)
        for at, column in enumerate(columns)
        if column not in RUN_JSON and column != "status" and column not in RUN_TIMES
    ]


def transition_params(transition: TransitionRecord, stamp: Stamp) -> tuple[Any, ...]:
    """A transition's values, in the order of the journals' INSERT."""
    return (
        transition.run_id,
        transition.seq,
        transition.from_state,
        transition.event,
        transition.to_state,
        transition.iteration,
        transition.attempt,
        stamp(transition.at),
        transition.duration_ms,
        dumps(transition.result),
        transition.lease_token,
    )


def iteration_params(record: IterationRecord, stamp: Stamp) -> tuple[Any, ...]:
    """An iteration record's values, in :data:`ITERATION_COLUMNS` order."""
    values: list[Any] = []
    for column in ITERATION_COLUMNS:
        value = getattr(record, column)
        if column in ITERATION_JSON:
            value = dumps(converter.unstructure(value))
        elif isinstance(value, dt.datetime):
            value = stamp(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        else:
            _check_column(value, column)
        values.append(value)
    return tuple(values)


def artifact_params(artifact: ArtifactRecord, stamp: Stamp) -> tuple[Any, ...]:
    """An artifact's values, in :data:`ARTIFACT_COLUMNS` order."""
    values: list[Any] = []
    for column in ARTIFACT_COLUMNS:
        value = getattr(artifact, column)
        if column == "content":
            value = dumps(value)
        elif isinstance(value, dt.datetime):
            value = stamp(value)
        else:
            _check_column(value, column)
        values.append(value)
    return tuple(values)


def effect_params(record: EffectRecord, stamp: Stamp) -> tuple[Any, ...]:
    """An effect record's values, in :data:`EFFECT_COLUMNS` order."""
    values: list[Any] = []
    for column in EFFECT_COLUMNS:
        value = getattr(record, column)
        if column in EFFECT_JSON:
            value = dumps(value)
        elif isinstance(value, dt.datetime):
            value = stamp(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        values.append(value)
    return tuple(values)


def signal_params(signal: SignalRecord, received_at: Any) -> tuple[Any, ...]:
    """A new signal's values: run id, name, payload (JSON text), signal id, ``received_at``.

    ``received_at`` is given as the journal stores it; the number is the journal's to give.

    Raises:
        JournalError: the payload, the name or the signal id cannot be stored as given
            (:func:`dumps`); nothing was written.
    """
    for column in ("run_id", "name", "signal_id"):
        _check_column(getattr(signal, column), column)
    return (signal.run_id, signal.name, dumps(signal.payload), signal.signal_id, received_at)


def decode_signal(row: Sequence[Any], loads: Loads, *, ended: bool, location: str) -> SignalRecord:
    """A signals row (:data:`SIGNAL_COLUMNS`) as a record of a run that has ``ended`` or not.

    Its status is derived: consumed once it has a ``consumed_seq``; else pending, or expired
    when the run has ended. Times are read as either journal stores them.

    Raises:
        JournalError: the row cannot be read (a damaged time or payload), naming the signal
            and the journal (``location``): a row that cannot be read is never misread.
    """
    run_id, number, name, payload, signal_id, received_at, consumed_seq, consumed_at = row
    if consumed_seq is not None:
        status = SignalStatus.CONSUMED
    else:
        status = SignalStatus.EXPIRED if ended else SignalStatus.PENDING
    try:
        return SignalRecord(
            run_id,
            number,
            name,
            loads(payload),
            signal_id,
            parse_utc(received_at),
            status,
            consumed_seq,
            None if consumed_at is None else parse_utc(consumed_at),
        )
    except (ValueError, TypeError) as exc:
        raise JournalError(
            f"signal {number} of run {run_id!r} has an unreadable row ({exc}); 'fsm-runner"
            " check' says what is damaged",
            path=location,
        ) from None


def decode_iteration(data: dict[str, Any], loads: Loads) -> dict[str, Any]:
    """An iterations row, by column, ready to structure: JSON parsed, flags as bools."""
    for column in ITERATION_JSON:
        data[column] = loads(data[column])
    for column in _ITERATION_FLAGS:  # SQLite stores booleans as 0/1
        if data[column] is not None:
            data[column] = bool(data[column])
    return data


def decode_effect(data: dict[str, Any], loads: Loads) -> dict[str, Any]:
    """An effects row, by column, ready to structure: JSON parsed, ``idempotent`` a bool."""
    for column in EFFECT_JSON:
        data[column] = loads(data[column])
    data["idempotent"] = bool(data["idempotent"])
    return data


def check_fork(run: RunRecord, at_seq: int) -> None:
    """Refuse a forked run that is not at ``at_seq``, the seq it forks at.

    Raises:
        ValueError: ``run.seq`` is not ``at_seq``.
    """
    if run.seq != at_seq:
        raise ValueError(f"the forked run must be at seq {at_seq}, not {run.seq}")


def check_fork_source(source_run_id: str, last_seq: int, at_seq: int) -> None:
    """Refuse a fork at a seq the source run (at ``last_seq``) does not have.

    Raises:
        ValueError: ``at_seq`` is negative or beyond ``last_seq``.
    """
    if not 0 <= at_seq <= last_seq:
        raise ValueError(f"run {source_run_id} has seqs 0..{last_seq}; there is no seq {at_seq}")
