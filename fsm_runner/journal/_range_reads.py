"""What ``check`` reads of a SQL journal in bulk: every run of a key range, whole, in two reads.

Both SQL journals' ``read_runs`` (:meth:`fsm_runner.journal.sqlite.SqliteJournal.read_runs`):
the transitions of a range of keys then their runs' rows, each in its primary key's order,
and each run built as reading it alone would (:func:`fsm_runner.replay.read_run`).
"""

from __future__ import annotations

import datetime as dt
import json
import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from fsm_runner.exceptions import FsmRunnerError, RunNotFoundError
from fsm_runner.journal import _rows
from fsm_runner.journal._sql import SqlCore
from fsm_runner.records import RunRecord, TransitionRecord, parse_utc, positional_builder
from fsm_runner.spec import RunLifecycle

__all__ = ["RunRead", "read_runs"]

#: A run as ``read_runs`` gives it: its id, and its transitions and row or why they cannot be read.
RunRead = tuple[str, "tuple[list[TransitionRecord], RunRecord] | FsmRunnerError"]
_new_transition = positional_builder(TransitionRecord)
_UTC = dt.timezone.utc
_fromisoformat = dt.datetime.fromisoformat


def read_runs(
    core: SqlCore,
    key: str,
    transition_select: str,
    first: Any,
    last: Any,
    *,
    since: dt.datetime | None,
    more: Callable[[str, int, int], list[TransitionRecord]],
    rows_read: Callable[[Sequence[str], Sequence[Sequence[Any]]], object] | None = None,
) -> list[RunRead]:
    """The runs whose ``key`` is in ``[first, last]`` (updated since ``since``), in order.

    Two range reads in the primary keys' order, the transitions then the rows (as
    :func:`fsm_runner.replay.read_run` reads one run); each run as reading it alone gives
    it: a row that moved on meanwhile gets the transitions it is ahead by from
    ``more(run_id, from, to)``, its transitions are decoded before its row (an unreadable
    one is the same error), and a run pruned meanwhile is left out. ``rows_read`` is given the
    transitions' column names and rows as read, before any is decoded (a check of the stored
    values themselves: SQLite's hash chains).
    """
    m = core.dialect.mark
    where, params = f"{key} BETWEEN {m} AND {m}", [first, last]
    transition_names, transition_rows = core._select(
        f"SELECT {transition_select} FROM transitions WHERE {where} ORDER BY {key}, seq",
        params,
    )
    if since is not None:
        where += f" AND updated_at >= {m}"
        params.append(core._stamp(since))
    run_names, run_rows = core._select(
        f"SELECT {core.dialect.run_select} FROM runs WHERE {where} ORDER BY {key}", params
    )
    if rows_read is not None:
        rows_read(transition_names, transition_rows)
    at = list(transition_names).index(key)
    fast = _typed_transitions(transition_names)
    fast_run = _typed_run(run_names)
    grouped: dict[Any, list[Sequence[Any]]] = {}
    for row in transition_rows:
        grouped.setdefault(row[at], []).append(row)
    run_at, key_at = list(run_names).index("run_id"), list(run_names).index(key)
    reads: list[RunRead] = []
    for row in run_rows:
        run_id = str(row[run_at])
        try:
            rows = grouped.get(row[key_at], [])
            timeline = fast(rows) if fast is not None else None
            if timeline is None:
                timeline = core.transition_records(transition_names, rows)
            run = fast_run(row) if fast_run is not None else None
            if run is None:  # by column, through the converter
                run = core.decode_run(dict(zip(run_names, row, strict=True)))
            last = timeline[-1].seq if timeline else -1
            if run.seq > last:
                timeline += more(run_id, last + 1, run.seq)
        except RunNotFoundError:
            continue  # pruned since the rows were read
        except FsmRunnerError as exc:
            reads.append((run_id, exc))
            continue
        reads.append((run_id, (timeline, run)))
    return reads


def _typed_transitions(
    names: Sequence[str],
) -> Callable[[Sequence[Sequence[Any]]], list[TransitionRecord] | None] | None:
    """Builds a run's transitions from rows whose values have their fields' own types, or ``None``.

    What a check reads in bulk is, but for a damaged row, exactly what the converter would
    take as it is (its hooks: a string to ``parse_utc``, a JSON object); built directly, a
    transition costs a third of what :meth:`SqlCore.transition_records` spends on it. Any row
    that is not so typed (a ``NULL`` taking a default, a number stored as text, a JSON value
    that is not an object, unreadable JSON) makes it return ``None``: those rows then go
    through the converter, which decodes them or names what is wrong exactly as before.
    """
    try:
        pick = operator.itemgetter(*[list(names).index(name) for name in _rows.TRANSITION_COLUMNS])
    except ValueError:
        return None  # a journal without one of the columns: the converter's defaults apply

    def build(rows: Sequence[Sequence[Any]]) -> list[TransitionRecord] | None:
        records = []
        for row in rows:
            run_id, seq, from_state, event, to_state, iteration, attempt, at, ms, result, token = (
                pick(row)
            )
            if not (
                type(run_id) is str
                and type(seq) is int
                and (from_state is None or type(from_state) is str)
                and type(event) is str
                and type(to_state) is str
                and type(iteration) is int
                and type(attempt) is int
                and (type(at) is str or type(at) is dt.datetime)
                and type(ms) is float
                and type(token) is int
            ):
                return None
            if result is not None:
                if type(result) is not str:
                    return None
                try:
                    result = json.loads(result)
                except ValueError:
                    return None
                if type(result) is not dict:
                    return None
            try:  # parse_utc, its common case inlined (a call less a transition)
                when = _fromisoformat(at) if isinstance(at, str) else at
            except ValueError:
                return None
            if when.tzinfo is not _UTC:
                when = parse_utc(when)
            fields = (run_id, seq, from_state, event, to_state, iteration, attempt, when, ms)
            records.append(_new_transition(*fields, result, token))
        return records

    return build


_RUN_FIELDS = tuple(field.name for field in attrs.fields(RunRecord))
_new_run = positional_builder(RunRecord)


def _typed_run(names: Sequence[str]) -> Callable[[Sequence[Any]], RunRecord | None] | None:
    """Builds a run from a row whose values have their fields' own types, or ``None``.

    As :func:`_typed_transitions` does for transitions: what the converter would give a row of
    plain text, integers and JSON objects (its hooks: ``parse_utc``, the status by value),
    built directly. Anything else (a ``NULL`` taking a default, a value of another type, JSON
    that does not parse or is not an object where one is due, an unknown status) gives
    ``None``: that row then goes through the converter, which decodes it or names what is
    wrong exactly as before.
    """
    try:
        pick = operator.itemgetter(*[list(names).index(name) for name in _RUN_FIELDS])
    except ValueError:
        return None  # a journal without one of the columns: the converter's defaults apply

    def build(row: Sequence[Any]) -> RunRecord | None:
        values = list(pick(row))
        (run_id, machine, spec_hash, state, status, seq, iteration, attempt, given, context,
         error, created_at, updated_at, *rest) = values  # fmt: skip
        expires = rest[4]  # after parent_run_id, forked_from, abort_reason, lease_owner
        if not (
            type(run_id) is str
            and type(machine) is str
            and type(spec_hash) is str
            and type(state) is str
            and type(status) is str
            and type(seq) is int
            and type(iteration) is int
            and type(attempt) is int
            and (given is None or type(given) is str)  # NULL: the default, None
            and type(context) is str
            and (error is None or type(error) is str)
            and type(created_at) is str
            and type(updated_at) is str
            and all(value is None or type(value) is str for value in rest[:4])
            and (expires is None or type(expires) is str)
            and type(rest[5]) is int  # lease_token
            and (rest[6] is None or type(rest[6]) is str)  # return_to
            and all(type(value) is int for value in rest[7:])  # attempts, visits, recoveries
        ):
            return None
        try:
            values[4] = RunLifecycle(status)
            values[8] = None if given is None else json.loads(given)
            values[9] = json.loads(context)
            values[10] = None if error is None else json.loads(error)
            values[11], values[12] = parse_utc(created_at), parse_utc(updated_at)
            values[17] = None if expires is None else parse_utc(expires)
        except (ValueError, RecursionError, OverflowError):  # the converter's path says why
            return None
        if type(values[9]) is not dict or not (values[10] is None or type(values[10]) is dict):
            return None
        return _new_run(*values)

    return build
