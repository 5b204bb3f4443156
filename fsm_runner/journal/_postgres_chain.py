"""A PostgreSQL journal's digests: the same as a SQLite journal's, for the same records.

Each run's transitions form a hash chain and its run row, iterations, effects and artifacts
carry a digest each of their own values (see :mod:`~fsm_runner.journal._digest`), over the
text a SQLite journal stores for them: the same JSON text, and every time as
:func:`~fsm_runner.records.format_utc` writes it (PostgreSQL stores a ``timestamptz``, to the
microsecond, which reads back as the same text). So a run's digests are the same whichever SQL
journal holds it, and an exported run verifies the same way. The writers
(:mod:`~fsm_runner.journal._postgres_writes`) compute them from the values they bind, in the
statements they already run; here they are computed from the values read back: for migration
9 (the rows a journal held then, once), for a fork's copies, and for ``check``.

PostgreSQL has no BLAKE2b: every digest is computed in Python, the rows read and written
back in batches (:data:`BATCH` rows a read, in key order).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import operator
from collections.abc import Iterator, Sequence
from typing import Any

from fsm_runner.journal import _rows
from fsm_runner.journal._digest import (
    RUN_DIGEST_COLUMNS,
    SIGNAL_DIGEST_COLUMNS,
    TRANSITION_DIGEST_COLUMNS,
    row_digest,
    row_hasher,
    transition_digest,
)
from fsm_runner.journal._postgres_connection import Connection
from fsm_runner.journal._sqlite_chain import MIGRATED, MIGRATED_KEYS, consumption_problem
from fsm_runner.journal._sqlite_chain import origin as _origin
from fsm_runner.records import RunRecord, format_utc, utc_now

__all__ = [
    "BATCH",
    "as_text",
    "chain_problems",
    "fill_digests",
    "fill_signal_digests",
    "m0009_fill_digests",
    "own_digest",
    "run_digest",
    "run_hasher",
    "signal_digest",
    "transition_chain_digest",
]

#: Rows read (and digests written back) a round trip.
BATCH = 5000
#: Where a transition's result is among the values its digest covers.
_RESULT = TRANSITION_DIGEST_COLUMNS.index("result")
_DATETIME = dt.datetime

#: The tables with a digest of each row's own values: (table, columns covered, the columns
#: that name a row, how a problem names it).
_ROW_TABLES: tuple[tuple[str, Sequence[str], tuple[str, ...], str], ...] = (
    ("iterations", _rows.ITERATION_COLUMNS, ("run_id", "iteration"), "iteration {1}"),
    ("effects", _rows.EFFECT_COLUMNS, ("run_id", "visit_seq", "name"), "effect {2!r} of visit {1}"),
    ("artifacts", _rows.ARTIFACT_COLUMNS, ("run_id", "name"), "artifact {1!r}"),
)
#: Each table's columns that find one row (for the UPDATE of its digest).
_ROW_IDS = {
    "runs": ("run_id",),
    "iterations": ("run_id", "iteration"),
    "effects": ("rowid",),
    "artifacts": ("id",),
    "signals": ("number",),
}
_ID_TYPES = {
    "run_id": "text", "iteration": "bigint", "rowid": "bigint", "id": "bigint", "number": "bigint"
}  # fmt: skip
#: Where :data:`~._digest.RUN_DIGEST_COLUMNS` are in a run row's parameters.
_run_digested = operator.itemgetter(
    *[_rows.RUN_COLUMNS.index(column) for column in RUN_DIGEST_COLUMNS]
)


def as_text(values: Sequence[Any]) -> tuple[Any, ...]:
    """``values`` with each time as the SQLite journal stores it (the text a digest covers)."""
    return tuple(format_utc(v) if type(v) is _DATETIME else v for v in values)


def own_digest(params: Sequence[Any]) -> str:
    """The digest of an iteration's, effect's or artifact's parameters as PostgreSQL binds them."""
    return row_digest(as_text(params))


def run_digest(params: Sequence[Any]) -> str:
    """The digest of a run row from its parameters (``_rows.RUN_COLUMNS``, as PostgreSQL binds)."""
    return row_digest(as_text(_run_digested(params)))


def run_hasher(run: RunRecord) -> Any:
    """The hash state of what ``run``'s row digest covers before its context (:func:`row_hasher`).

    Who the run is and its input: :data:`~._digest.RUN_DIGEST_COLUMNS` but the last two, so
    that ``row_digest_from(run_hasher(run), (context, error))`` is the run row's digest.
    """
    return row_hasher(
        (
            run.run_id,
            run.machine,
            format_utc(run.created_at),
            run.parent_run_id,
            run.forked_from,
            _rows.dumps(run.input),
        )
    )


def transition_chain_digest(previous: str | None, params: Sequence[Any]) -> str:
    """A transition's digest from its parameters as PostgreSQL binds them (its time a datetime)."""
    values = list(params)
    values[7] = format_utc(values[7])
    return transition_digest(previous, tuple(values))


def _batches(
    conn: Connection,
    table: str,
    select: Sequence[str],
    *,
    run_id: str | None = None,
) -> Iterator[list[Any]]:
    """The rows of ``table`` (``select``'s columns after the row's ids), :data:`BATCH` a read.

    In the order of the table's ids (a key or an index), each read after the last row of the
    one before (keyset): plain reads, no transaction or cursor held between them, so a check
    beside live writers holds nothing up. ``run_id``: that run's rows only.
    """
    ids = _ROW_IDS.get(table, ("run_id", "seq"))
    head = f"SELECT {', '.join((*ids, *select))} FROM {table}"
    order = f" ORDER BY {', '.join(ids)} LIMIT {BATCH}"
    after = f"({', '.join(ids)}) > ({', '.join(['%s'] * len(ids))})"
    where = [] if run_id is None else ["run_id = %s"]
    args: list[Any] = [] if run_id is None else [run_id]
    last: Sequence[Any] = ()
    while True:
        conditions = [*where, after] if last else where
        text = head + (" WHERE " + " AND ".join(conditions) if conditions else "") + order
        rows = conn.execute(text, [*args, *last]).fetchall()
        if rows:
            yield rows
        if len(rows) < BATCH:
            return
        last = rows[-1][: len(ids)]


def _update(conn: Connection, table: str, updates: list[tuple[Any, ...]]) -> None:
    """Write digests back: ``updates`` are (digest, *the row's ids*), one statement."""
    if not updates:
        return
    ids = _ROW_IDS.get(table, ("run_id", "seq"))
    columns = list(zip(*updates, strict=True))
    types = ["text", *(_ID_TYPES.get(name, "bigint") for name in ids)]
    unnest = ", ".join(f"%s::{kind}[]" for kind in types)
    conn.execute(
        f"UPDATE {table} AS t SET digest = v.digest FROM unnest({unnest})"
        f" AS v(digest, {', '.join(ids)}) WHERE "
        + " AND ".join(f"t.{name} = v.{name}" for name in ids),
        [list(column) for column in columns],
    )


def fill_digests(conn: Connection, *, run_id: str | None = None) -> None:
    """Compute and store rows' digests from their values as stored (inside a transaction).

    Every row's (migration 9), or one run's (``run_id``: a fork's copies).
    """
    previous: str | None = None
    last = None
    for rows in _batches(conn, "transitions", TRANSITION_DIGEST_COLUMNS, run_id=run_id):
        updates = []
        for row in rows:
            values = row[2:]
            if row[0] != last:
                previous, last = None, row[0]
            previous = transition_digest(previous, as_text(values))
            updates.append((previous, row[0], row[1]))
        _update(conn, "transitions", updates)
    tables = [("runs", RUN_DIGEST_COLUMNS), *((t, c) for t, c, _, _ in _ROW_TABLES)]
    for table, columns in tables:
        n = len(_ROW_IDS[table])
        for rows in _batches(conn, table, columns, run_id=run_id):
            _update(conn, table, [(row_digest(as_text(row[n:])), *row[:n]) for row in rows])


def signal_digest(params: Sequence[Any]) -> str:
    """A signal's digest from its parameters (:data:`~._digest.SIGNAL_DIGEST_COLUMNS`)."""
    return row_digest(as_text(params))


def fill_signal_digests(conn: Connection) -> None:
    """Migration 10's Python step: the digests of the signals the journal holds."""
    for rows in _batches(conn, "signals", SIGNAL_DIGEST_COLUMNS):
        _update(conn, "signals", [(signal_digest(row[1:]), row[0]) for row in rows])


def _signal_problems(conn: Connection, named: dict[tuple[str, int], Any]) -> list[str]:
    """Signals that do not match their digest, or whose consumption the chain does not say.

    As the SQLite journal's: a signal of the run marked consumed at a seq whose transition does
    not name it, or named by a transition of its run but not marked consumed there (pending
    again: it would be delivered twice). ``named``: the signal each transition that consumed
    one names in its result (``"signal": NUMBER``, which the chain vouches for), by run and seq.
    """
    problems = []
    consumed: dict[tuple[str, int], int | None] = {}
    for rows in _batches(
        conn, "signals", ("run_id", "consumed_seq", "digest", *SIGNAL_DIGEST_COLUMNS)
    ):
        for number, run_id, consumed_seq, stored, *values in rows:
            consumed[run_id, number] = consumed_seq
            if stored is not None and stored != signal_digest(values):
                problems.append(
                    f"digest: run {run_id}: its signal {number} does not match its digest"
                    " (changed since it was written)"
                )
            if consumed_seq is not None and named.get((run_id, consumed_seq)) != number:
                problems.append(consumption_problem(run_id, number, consumed_seq, None))
    problems += [
        consumption_problem(run_id, number, None, seq)
        for (run_id, seq), number in named.items()
        if (run_id, number) in consumed and consumed[run_id, number] != seq
    ]
    return problems


def _named_signal(result: Any) -> Any:
    """The signal a transition's result says it consumed (``None``: none, or not readable)."""
    if not isinstance(result, str) or '"signal"' not in result:
        return None
    try:
        found = json.loads(result)
    except ValueError:
        return None
    return found.get("signal") if isinstance(found, dict) else None


def m0009_fill_digests(conn: Connection) -> None:
    """Migration 9's Python step: the digests of the rows the journal holds, and their origin.

    ``meta`` says when (:data:`~._sqlite_chain.MIGRATED`) and up to which run
    (:data:`~._sqlite_chain.MIGRATED_KEYS`: on PostgreSQL the highest ``runs.rowid``), as the
    SQLite journal's migration 11 does: ``check`` then says that such a run's digests vouch only
    for what the migration read.
    """
    found = conn.execute("SELECT max(rowid) FROM runs").fetchone()
    last = None if found is None else found[0]
    fill_digests(conn)
    if last is not None:
        when = format_utc(utc_now())[:10]
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (%s, %s), (%s, %s)"
            " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            (MIGRATED, f"computed at migration to version 9 on {when}", MIGRATED_KEYS, str(last)),
        )


def chain_problems(conn: Connection) -> list[str]:
    """The rows whose content no longer matches their digest: one line per run, row or table.

    As the SQLite journal's (:func:`~._sqlite_chain.chain_problems`): each run's chain is
    verified seq by seq against the digest each transition stores, so the line names the
    first seq whose content (or digest) changed.
    """
    migrated = _migrated(conn)
    rowids: dict[Any, Any] = dict(conn.execute("SELECT run_id, rowid FROM runs").fetchall())
    first_bad: dict[str, int] = {}
    consumed_by: dict[tuple[str, int], Any] = {}  # the signal a transition consumed, if any
    expected: str | None = None
    last = None
    for rows in _batches(conn, "transitions", ("digest", *TRANSITION_DIGEST_COLUMNS)):
        for run_id, seq, stored, *values in rows:
            signal = _named_signal(values[_RESULT])
            if signal is not None:
                consumed_by[run_id, seq] = signal
            if run_id != last:
                expected, last = None, run_id
            if run_id in first_bad:
                continue
            expected = transition_digest(expected, as_text(values))
            if stored != expected:
                first_bad[run_id] = seq
            expected = stored if isinstance(stored, str) else expected
    problems = [
        f"digest: run {run_id} at seq {seq}: the transition does not match its digest"
        " (changed since it was written)" + _origin(rowids.get(run_id), migrated)
        for run_id, seq in first_bad.items()
    ]
    for rows in _batches(conn, "runs", ("rowid", "digest", *RUN_DIGEST_COLUMNS)):
        problems += [
            f"digest: run {run_id}: its row (input, context, error) does not match its digest"
            " (changed since it was written)" + _origin(rowid, migrated)
            for run_id, rowid, stored, *values in rows
            if stored != row_digest(as_text(values))
        ]
    for table, columns, names, named in _ROW_TABLES:
        n, k = len(_ROW_IDS[table]), len(names)
        for rows in _batches(conn, table, (*names, "digest", *columns)):
            problems += [
                f"digest: run {row[n]}: its {named.format(*row[n : n + k])} does not match its"
                " digest (changed since it was written)" + _origin(rowids.get(row[n]), migrated)
                for row in rows
                if row[n + k] != row_digest(as_text(row[n + k + 1 :]))
            ]
    return problems + _signal_problems(conn, consumed_by)


def _migrated(conn: Connection) -> tuple[str, int] | None:
    """When migration 9 computed the digests of the runs it found, and up to which rowid."""
    found: dict[Any, Any] = dict(
        conn.execute(
            "SELECT key, value FROM meta WHERE key IN (%s, %s)", (MIGRATED, MIGRATED_KEYS)
        ).fetchall()
    )
    with contextlib.suppress(KeyError, ValueError):
        return str(found[MIGRATED]), int(found[MIGRATED_KEYS])
    return None
