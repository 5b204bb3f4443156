"""PostgreSQL statements that write many rows at once: group commits and starts (issue 33).

A group of one-statement commits (:data:`~._postgres_writes._COMMIT`, one per run) sent as
that many statements costs the server each statement's own start and end (~100 µs a step
here), pipelined or not. :data:`GROUP_COMMIT` does the group's work in one statement: the
commits' values bound as one array a column, unnested into rows; one ``UPDATE ... FROM`` moves
every run row whose fence admits its commit (the very conditions of the one-statement commit:
at the seq before, under the lease token it holds, no abort requested under that token but
for the ``USER_ABORTED`` that carries it out), and one ``INSERT ... SELECT`` writes the
transitions of the runs it moved. If it moved fewer than all (a commit refused) the caller
rolls the group back and sends it the careful way, a savepoint a commit, so a refusal refuses
its commit alone, as before.

Used for a group whose commits each move a different run (an ``UPDATE ... FROM`` moves a row
once however many rows join it); a group with two commits of one run is pipelined instead.
:data:`GROUP_NARROW` is that statement for steps that leave most of the run row as it is.

A start of a few runs is one statement too (:func:`start_statement`): the spec, the run rows and
their transitions seq 0; so is a start of many (:data:`BULK_START`, its values as arrays).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from fsm_runner.journal import _rows

__all__ = [
    "BULK_START",
    "BULK_STARTS",
    "COMMIT_PARAMS",
    "GROUP_COMMIT",
    "GROUP_NARROW",
    "INSERT_SPEC",
    "ONE_STATEMENT_STARTS",
    "STORED_RUN_COLUMNS",
    "STORED_TRANSITION_COLUMNS",
    "bulk_start_params",
    "group_statement",
    "start_statement",
]

#: A run row's and a transition's columns as inserted: each digest last (schema 9).
STORED_RUN_COLUMNS = (*_rows.RUN_COLUMNS, "digest")
STORED_TRANSITION_COLUMNS = (*_rows.TRANSITION_COLUMNS, "digest")
INSERT_SPEC = (
    "INSERT INTO specs (spec_hash, machine, json, created_at) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (spec_hash) DO NOTHING"
)


#: Starts of at most this many runs (and no iterations) are one statement, one round trip instead
#: of five: a start 646 -> 326 us here, 2 runs 428 -> 272 us a run. Bigger batches are pipelined
#: (``executemany``): one statement of 10 runs was no faster, of 30 slower (its parsing).
ONE_STATEMENT_STARTS = 8


@functools.lru_cache(maxsize=32)
def start_statement(runs: int) -> str:
    """The spec, ``runs`` run rows and their transitions seq 0, inserted by one statement."""

    def values(width: int) -> str:
        row = "(" + ", ".join(["%s"] * width) + ")"
        return ", ".join([row] * runs)

    return (
        f"WITH spec AS ({INSERT_SPEC}),"
        f" new_runs AS (INSERT INTO runs ({', '.join(STORED_RUN_COLUMNS)})"
        f" VALUES {values(len(STORED_RUN_COLUMNS))})"
        f" INSERT INTO transitions ({', '.join(STORED_TRANSITION_COLUMNS)})"
        f" VALUES {values(len(STORED_TRANSITION_COLUMNS))}"
    )


#: Starts of more runs than this (and no iterations) are :data:`BULK_START`: 10,000 runs
#: 0.65-0.75 -> 0.54-0.58 s, the client's CPU 0.31 -> 0.23 s. Fewer go the pipelined
#: ``executemany`` way, one statement a row (a backend killed inside such a pipeline is
#: ``test_postgres_attacks``'s).
BULK_STARTS = 100

#: The SQL type of each column a start writes (a run row's, then a transition's, digests last).
_START_TYPES = {
    **dict.fromkeys(
        ("run_id", "machine", "spec_hash", "state", "status", "input", "context", "error"), "text"
    ),
    **dict.fromkeys(("parent_run_id", "forked_from", "abort_reason", "lease_owner"), "text"),
    **dict.fromkeys(("return_to", "digest", "from_state", "event", "to_state", "result"), "text"),
    **dict.fromkeys(("seq", "iteration", "attempt", "lease_token", "return_attempt"), "bigint"),
    **dict.fromkeys(("visit_seq", "return_visit", "recoveries"), "bigint"),
    **dict.fromkeys(("created_at", "updated_at", "lease_expires_at", "at"), "timestamptz"),
    "duration_ms": "double precision",
}


def _arrays(columns: Sequence[str]) -> str:
    return ", ".join(f"%b::{_START_TYPES[column]}[]" for column in columns)


#: A start of many runs: the spec, the run rows and their transitions seq 0 in one statement,
#: each table's values bound as one array a column (:func:`bulk_start_params`), instead of a
#: pipeline of one statement a row (each its own bind and execute on the server, and ~10 µs of
#: psycopg's Python a row on the client).
BULK_START = (
    f"WITH spec AS ({INSERT_SPEC}),"
    f" new_runs AS (INSERT INTO runs ({', '.join(STORED_RUN_COLUMNS)})"
    f" SELECT * FROM unnest({_arrays(STORED_RUN_COLUMNS)}))"
    f" INSERT INTO transitions ({', '.join(STORED_TRANSITION_COLUMNS)})"
    f" SELECT * FROM unnest({_arrays(STORED_TRANSITION_COLUMNS)})"
)


def bulk_start_params(
    spec_row: Sequence[Any],
    run_rows: Sequence[Sequence[Any]],
    transition_rows: Sequence[Sequence[Any]],
) -> list[Any]:
    """:data:`BULK_START`'s parameters: the spec's values, then one list a column of each table."""
    return [
        *spec_row,
        *map(list, zip(*run_rows, strict=True)),
        *map(list, zip(*transition_rows, strict=True)),
    ]


#: The columns of the unnested rows: (name, SQL array type, the one-statement commit's
#: parameter it takes). The one-statement commit binds ``aborting`` three times and ``ended``
#: three times (indexes 13, 14, 21 and 15-17): the first of each is taken.
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("state", "text", 0),
    ("seq", "bigint", 1),
    ("iteration", "bigint", 2),
    ("updated_at", "timestamptz", 3),
    ("status", "text", 4),
    ("attempt", "bigint", 5),
    ("context", "text", 6),
    ("error", "text", 7),
    ("run_digest", "text", 8),
    ("return_to", "text", 9),
    ("return_attempt", "bigint", 10),
    ("return_visit", "bigint", 11),
    ("visit_seq", "bigint", 12),
    ("aborting", "boolean", 13),
    ("ended", "boolean", 15),
    ("run_id", "text", 18),
    ("before_seq", "bigint", 19),
    ("token", "bigint", 20),
    ("t_seq", "bigint", 22),
    ("t_from_state", "text", 23),
    ("t_event", "text", 24),
    ("t_to_state", "text", 25),
    ("t_iteration", "bigint", 26),
    ("t_attempt", "bigint", 27),
    ("t_at", "timestamptz", 28),
    ("t_duration_ms", "double precision", 29),
    ("t_result", "text", 30),
    ("t_lease_token", "bigint", 31),
    ("t_digest", "text", 32),
)
#: How many parameters the one-statement commit binds (without a spec).
COMMIT_PARAMS = 33


def _unnested(columns: Sequence[tuple[str, str, int]]) -> str:
    """``WITH i AS (...)``: the group's values, bound as one array a column, as rows."""
    return (
        f"WITH i AS (SELECT * FROM unnest({', '.join(f'%b::{kind}[]' for _, kind, _ in columns)})"
        f" AS i({', '.join(name for name, _, _ in columns)}))"
    )


GROUP_COMMIT = (
    _unnested(_COLUMNS)
    + """, moved AS (
    UPDATE runs AS r
       SET state = i.state, seq = i.seq, iteration = i.iteration, updated_at = i.updated_at,
           status = i.status, attempt = i.attempt, context = i.context, error = i.error,
           digest = i.run_digest, return_to = i.return_to, return_attempt = i.return_attempt,
           return_visit = i.return_visit, visit_seq = i.visit_seq,
           abort_reason = CASE WHEN i.aborting THEN NULL ELSE r.abort_reason END,
           abort_token = CASE WHEN i.aborting THEN NULL ELSE r.abort_token END,
           lease_owner = CASE WHEN i.ended THEN NULL ELSE r.lease_owner END,
           lease_expires_at = CASE WHEN i.ended THEN NULL ELSE r.lease_expires_at END,
           wake_at = CASE WHEN i.ended THEN NULL ELSE r.wake_at END
      FROM i
     WHERE r.run_id = i.run_id AND r.seq = i.before_seq AND r.lease_token = i.token
       AND (r.abort_token IS NULL OR r.abort_token < r.lease_token OR i.aborting)
    RETURNING r.run_id
)
INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,
                         duration_ms, result, lease_token, digest)
SELECT i.run_id, i.t_seq, i.t_from_state, i.t_event, i.t_to_state, i.t_iteration,
       i.t_attempt, i.t_at, i.t_duration_ms, i.t_result, i.t_lease_token, i.t_digest
  FROM i JOIN moved ON moved.run_id = i.run_id
"""
)


#: The columns :data:`GROUP_NARROW` takes: what a step whose run keeps its digest (its input,
#: context and error), with nowhere to return to and no abort to carry out, changes in the run
#: row, and its transition (less the values the row's repeat: seq, state, iteration, time, token).
_NARROW_COLUMNS = tuple(
    column
    for column in _COLUMNS
    if column[0]
    not in (
        *("seq", "context", "error", "return_to", "return_attempt", "return_visit"),
        *("aborting", "before_seq", "t_to_state", "t_iteration", "t_at", "t_lease_token"),
    )
)

#: :data:`GROUP_COMMIT` for a group of such steps (issue 33): 17 columns unnested instead of
#: 33 (each a parameter the client builds and the server parses, 1,000 values each), and the
#: row's context, error and digest left as they are -- only where the row holds that digest:
#: a row that does not (the writer's memory of it stale) refuses the group, which is then
#: written the careful way (:data:`GROUP_COMMIT`'s statements, a savepoint each).
GROUP_NARROW = (
    _unnested(_NARROW_COLUMNS)
    + """, moved AS (
    UPDATE runs AS r
       SET state = i.state, seq = i.t_seq, iteration = i.iteration, updated_at = i.updated_at,
           status = i.status, attempt = i.attempt, return_to = NULL, return_attempt = 0,
           return_visit = 0, visit_seq = i.visit_seq,
           lease_owner = CASE WHEN i.ended THEN NULL ELSE r.lease_owner END,
           lease_expires_at = CASE WHEN i.ended THEN NULL ELSE r.lease_expires_at END,
           wake_at = CASE WHEN i.ended THEN NULL ELSE r.wake_at END
      FROM i
     WHERE r.run_id = i.run_id AND r.seq = i.t_seq - 1 AND r.lease_token = i.token
       AND (r.abort_token IS NULL OR r.abort_token < r.lease_token)
       AND r.digest = i.run_digest
    RETURNING r.run_id
)
INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,
                         duration_ms, result, lease_token, digest)
SELECT i.run_id, i.t_seq, i.t_from_state, i.t_event, i.state, i.iteration, i.t_attempt,
       i.updated_at, i.t_duration_ms, i.t_result, i.token, i.t_digest
  FROM i JOIN moved ON moved.run_id = i.run_id
"""
)


def group_statement(
    commits: Sequence[Sequence[Any]], *, narrow: bool
) -> tuple[str, list[list[Any]]]:
    """The statement of a group of one-statement commits, and its parameters (a list a column).

    ``commits``: the commits' parameters (:data:`COMMIT_PARAMS` each), of runs that differ;
    ``narrow``: each is a step :data:`GROUP_NARROW` may write.
    """
    statement, columns = (GROUP_NARROW, _NARROW_COLUMNS) if narrow else (GROUP_COMMIT, _COLUMNS)
    return statement, [[params[index] for params in commits] for _, _, index in columns]
