"""A SQLite journal's digests as stored: computed for a migration, verified for ``check``.

Each run's transitions form a hash chain (:mod:`~fsm_runner.journal._digest`); its run row,
iterations, effects and artifacts carry a digest each of their own values. The writers compute
them from the values they bind; here they are computed from the values read back — text
columns as bytes (``CAST(... AS BLOB)``), so a damaged byte is read as it is — which gives the
same text for every row written as fsm_runner writes it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsm_runner._shown import shown
from fsm_runner.exceptions import JournalError
from fsm_runner.journal import _rows
from fsm_runner.journal._digest import (
    RUN_DIGEST_COLUMNS,
    SIGNAL_DIGEST_COLUMNS,
    TRANSITION_DIGEST_COLUMNS,
    digest,
    row_digest,
    step_digest,
    stored_row_digest,
)
from fsm_runner.records import RunRecord, format_utc

__all__ = [
    "MIGRATED",
    "MIGRATED_KEYS",
    "chain_problems",
    "consumption_problem",
    "fill_digests",
    "fill_signal_digests",
    "head_rows",
    "head_sql",
    "history_rows",
    "load_sql",
    "migrated",
    "origin",
    "row_breaks",
    "row_with_digest",
    "run_digest",
    "stored_digest",
    "verifier",
    "with_digest",
]

#: The ``meta`` key saying when a migration computed the digests of the rows it found.
MIGRATED = "digests_computed"
#: The ``meta`` key holding the highest ``run_key`` whose digests a migration computed.
MIGRATED_KEYS = "digests_computed_to_run_key"

#: The tables with a digest of each row's own values: (table, columns covered, what names a
#: row in a problem: its columns, and how the problem reads).
_ROW_TABLES = (
    ("iterations", _rows.ITERATION_COLUMNS, "iteration {1}"),
    ("effects", _rows.EFFECT_COLUMNS, "effect {2!r} of visit {1}"),
    ("artifacts", _rows.ARTIFACT_COLUMNS, "artifact {1!r}"),
)
_ROW_KEYS = {
    "iterations": ("run_id", "iteration"),
    "effects": ("run_id", "visit_seq", "name"),
    "artifacts": ("run_id", "name"),
}


#: Where :data:`~._digest.RUN_DIGEST_COLUMNS` are in a run row's parameters.
_run_digested = operator.itemgetter(
    *[_rows.RUN_COLUMNS.index(column) for column in RUN_DIGEST_COLUMNS]
)


def with_digest(params: tuple[Any, ...]) -> tuple[Any, ...]:
    """A run row's parameters (``_rows.RUN_COLUMNS``) with its digest."""
    return (*params, row_digest(_run_digested(params)))


def row_with_digest(params: tuple[Any, ...]) -> tuple[Any, ...]:
    """An iteration's or artifact's parameters with its digest."""
    return (*params, row_digest(params))


def run_digest(run: RunRecord, context: str | None, error: str | None) -> str:
    """The digest of ``run``'s row, its ``context`` and ``error`` as written (JSON text)."""
    return row_digest(
        (
            run.run_id,
            run.machine,
            format_utc(run.created_at),
            run.parent_run_id,
            run.forked_from,
            _rows.dumps(run.input),
            context,
            error,
        )
    )


def stored_digest(conn: sqlite3.Connection, key: int, seq: int) -> str | None:
    """The digest of the run's transition ``seq`` as stored (``None``: there is none).

    Read only when a writer did not write that transition itself (a run it has not stepped,
    or that was stepped elsewhere since): a step chains to the head it wrote.
    """
    row = conn.execute(
        "SELECT digest FROM transitions WHERE run_key = ? AND seq = ?", (key, seq)
    ).fetchone()
    return None if row is None else row[0]


def head_sql(conn: sqlite3.Connection) -> str:
    """The read of a run's head rows for :func:`head_rows` (its text: once per journal).

    One statement of primary-key lookups: the run row, its last transition (the head: the
    last entry of the run's range of the transitions' key) and the digest of the one before.
    Its parameter: the run key.
    """
    run = _select(conn, "run_rows", RUN_DIGEST_COLUMNS, "r.")
    head = _select(conn, "transitions", TRANSITION_DIGEST_COLUMNS, "t.")
    return (
        f"SELECT r.digest, {run}, t.seq, t.digest, {head}, p.digest FROM run_rows AS r"
        " LEFT JOIN transitions AS t ON t.run_key = r.run_key"
        "  AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = r.run_key)"
        " LEFT JOIN transitions AS p ON p.run_key = r.run_key AND p.seq = t.seq - 1"
        " WHERE r.run_key = ?"
    )


#: The columns :func:`load_sql` adds to the ``runs`` view's: the run row's digest, the head
#: transition's seq, digest and values, the previous transition's digest.
LOAD_HEAD_COLUMNS = 4 + len(TRANSITION_DIGEST_COLUMNS)


def load_sql(conn: sqlite3.Connection) -> str:
    """A run's row from the ``runs`` view and its head rows, in one statement (a claim's load).

    The view's columns, then :data:`LOAD_HEAD_COLUMNS`: the run row's digest, its transition at
    the view's seq (the head: each value as bytes, an integer's as its decimal text, but
    ``duration_ms``), and the digest of the one before; two primary-key lookups more than the
    view's own. Its parameter: the run id.
    """
    head = ", ".join(  # as bytes (an integer's as its text), but for the float
        f"t.{column}" if column == "duration_ms" else f"CAST(t.{column} AS BLOB)"
        for column in TRANSITION_DIGEST_COLUMNS
    )
    return (
        f"SELECT v.*, r.digest, t.seq, t.digest, {head}, p.digest FROM runs AS v"
        " JOIN run_rows AS r ON r.run_key = v.run_key"
        " LEFT JOIN transitions AS t ON t.run_key = v.run_key AND t.seq = v.seq"
        " LEFT JOIN transitions AS p ON p.run_key = v.run_key AND p.seq = v.seq - 1"
        " WHERE v.run_id = ?"
    )


def head_rows(
    conn: sqlite3.Connection, sql: str, key: int
) -> tuple[int | None, Sequence[Any] | None, str | None, Sequence[Any] | None]:
    """A run's head seq and transition, its previous transition's digest, its run row.

    As stored, and as :func:`~fsm_runner.journal._head.verify_head` takes them (each row's
    digest first); ``sql``: :func:`head_sql`'s. All ``None``: no run has that key.
    """
    row = conn.execute(sql, (key,)).fetchone()
    if row is None:
        return None, None, None, None
    runs = 1 + len(RUN_DIGEST_COLUMNS)
    run_row, (seq, *head), previous = row[:runs], row[runs:-1], row[-1]
    return seq, (None if seq is None else head), previous, run_row


def history_rows(
    conn: sqlite3.Connection, key: int, to_seq: int
) -> tuple[list[tuple[int, str | None, list[Any]]], Sequence[Any] | None]:
    """A run's transitions up to ``to_seq`` (seq, digest, values) and its run row, as stored.

    As :func:`~fsm_runner.journal._head.verify_history` takes them.
    """
    select = _select(conn, "transitions", TRANSITION_DIGEST_COLUMNS)
    rows = conn.execute(
        f"SELECT seq, digest, {select} FROM transitions WHERE run_key = ? AND seq <= ?"
        " ORDER BY seq",
        (key, to_seq),
    )
    transitions = [(seq, stored, values) for seq, stored, *values in rows]
    run = _select(conn, "run_rows", RUN_DIGEST_COLUMNS)
    run_row = conn.execute(f"SELECT digest, {run} FROM run_rows WHERE run_key = ?", (key,))
    return transitions, run_row.fetchone()


def _select(conn: sqlite3.Connection, table: str, columns: Sequence[str], prefix: str = "") -> str:
    """The select list of ``columns`` as stored: text ones as their bytes."""
    affinity = {row[1]: str(row[2]).upper() for row in conn.execute(f"PRAGMA table_info({table})")}
    return ", ".join(
        f"CAST({prefix}{column} AS BLOB)"
        if any(word in affinity.get(column, "") for word in ("CHAR", "CLOB", "TEXT"))
        else f"{prefix}{column}"
        for column in columns
    )


def _transitions(conn: sqlite3.Connection, run_key: int | None = None) -> Iterator[Any]:
    """Transitions as (run_key, seq, stored digest, values covered), by run then seq."""
    select = _select(conn, "transitions", TRANSITION_DIGEST_COLUMNS)
    where = "" if run_key is None else " WHERE run_key = ?"
    return conn.execute(
        f"SELECT run_key, seq, digest, {select} FROM transitions{where} ORDER BY run_key, seq",
        () if run_key is None else (run_key,),
    )


def fill_digests(
    conn: sqlite3.Connection, *, run_key: int | None = None, run_id: str | None = None
) -> None:
    """Compute and store rows' digests from their values as stored.

    Every row's (a migration's), or one run's (``run_key`` and ``run_id``: a fork's copies).
    """
    updates: list[tuple[str, int, int]] = []
    previous: str | None = None
    last_key = None
    for key, seq, _, *values in _transitions(conn, run_key):
        if key != last_key:
            previous, last_key = None, key
        previous = digest(previous, values)
        updates.append((previous, key, seq))
    conn.executemany("UPDATE transitions SET digest = ? WHERE run_key = ? AND seq = ?", updates)
    where = "" if run_id is None else " WHERE run_id = ?"
    for table, columns in (("run_rows", RUN_DIGEST_COLUMNS), *_own_tables()):
        rows = conn.execute(
            f"SELECT rowid, {_select(conn, table, columns)} FROM {table}{where}",
            () if run_id is None else (run_id,),
        ).fetchall()
        conn.executemany(
            f"UPDATE {table} SET digest = ? WHERE rowid = ?",
            [(row_digest(values), rowid) for rowid, *values in rows],
        )


def fill_signal_digests(conn: sqlite3.Connection, *, run_id: str | None = None) -> None:
    """Compute and store signals' digests from their values as stored (schema 12's step)."""
    where = "" if run_id is None else " WHERE run_id = ?"
    rows = conn.execute(
        f"SELECT number, {_select(conn, 'signals', SIGNAL_DIGEST_COLUMNS)} FROM signals{where}",
        () if run_id is None else (run_id,),
    ).fetchall()
    conn.executemany(
        "UPDATE signals SET digest = ? WHERE number = ?",
        [(row_digest(values), number) for number, *values in rows],
    )


def _signal_problems(conn: sqlite3.Connection) -> list[str]:
    """Signals that do not match their digest, or whose consumption the chain does not say.

    A consumed signal is named by its consuming transition's result (``"signal": NUMBER``,
    which the run's chain vouches for): a signal of the run marked consumed at a seq whose
    transition does not name it, or one a transition of its run names that is not marked
    consumed there (made pending again: it would be delivered twice), is a problem too.
    """
    columns = [row[1] for row in conn.execute("PRAGMA table_info(signals)")]
    if "digest" not in columns:
        return []
    problems = []
    for number, run_id, stored, *values in conn.execute(
        f"SELECT number, run_id, digest, {_select(conn, 'signals', SIGNAL_DIGEST_COLUMNS)}"
        " FROM signals ORDER BY number"
    ):
        if stored is not None and stored != row_digest(values):
            problems.append(
                f"digest: run {_shown_id(run_id)}: its signal {number} does not match its"
                " digest (changed since it was written)"
            )
    mismatched = conn.execute(
        "SELECT s.run_id, s.number, s.consumed_seq, NULL FROM signals AS s"
        " LEFT JOIN transitions AS t ON t.run_key = s.run_key AND t.seq = s.consumed_seq"
        " WHERE s.consumed_seq IS NOT NULL AND (t.result IS NULL OR NOT json_valid(t.result)"
        " OR json_extract(t.result, '$.signal') IS NOT s.number)"
        " UNION ALL SELECT t.run_id, s.number, NULL, t.seq FROM transitions AS t"
        " JOIN signals AS s ON s.run_key = t.run_key"
        " AND s.number = json_extract(t.result, '$.signal')"
        " WHERE json_valid(t.result) AND s.consumed_seq IS NOT t.seq"
    )  # (a fork's copies name its source's signals, which are not the fork's: not joined)
    problems += [
        consumption_problem(_shown_id(run_id), number, consumed_seq, seq)
        for run_id, number, consumed_seq, seq in mismatched
    ]
    return problems


def consumption_problem(run: str, number: Any, consumed_seq: Any, seq: Any) -> str:
    """``check``'s line for a signal whose consumption the chain does not say (both journals).

    ``consumed_seq``: where the signal is marked consumed (its transition does not name it), or
    ``None``: the transition at ``seq`` names it, and it is not marked consumed there.
    """
    said = (
        f"marked consumed at seq {consumed_seq}, whose transition does not name it"
        if consumed_seq is not None
        else f"consumed at seq {seq} by the chain, not marked so"
    )
    return f"digest: run {run}: its signal {number} is {said}"


def _own_tables() -> list[tuple[str, Sequence[str]]]:
    return [(table, columns) for table, columns, _ in _ROW_TABLES]


def chain_problems(
    conn: sqlite3.Connection, *, transitions: bool = True, rows: bool = True
) -> list[str]:
    """The rows whose content no longer matches their digest: one line per run, row or table.

    A run's chain is verified seq by seq against the digest each transition stores, so the
    line names the first seq whose content (or digest) changed; a later one changed as well
    is found once the first is repaired. A run whose digests a migration computed says so:
    they vouch only for what the migration read. ``transitions``: the runs' chains;
    ``rows``: the other rows' digests (a check that read every run verified its chain as it
    went: :func:`row_breaks`).
    """
    try:
        migrated_to = migrated(conn)
        problems = []
        if rows:
            problems += _row_problems(conn, migrated_to)
            problems += _signal_problems(conn)
        if transitions:  # last: a check that verifies them as it reads the runs adds them so
            first_bad: dict[int, int] = {}
            expected: str | None = None
            last_key = None
            for key, seq, stored, *values in _transitions(conn):
                if key != last_key:
                    expected, last_key = None, key
                if key in first_bad:
                    continue
                expected = digest(expected, values)
                if stored != expected:
                    first_bad[key] = seq
                expected = stored if isinstance(stored, str) else expected
            names = _run_names(conn) if first_bad else {}
            problems += [
                _break_line(_name(names, key), seq, origin(key, migrated_to))
                for key, seq in first_bad.items()
            ]
    except sqlite3.Error as exc:  # a damaged table: the integrity check names it
        return [f"digest: the digests could not be verified ({exc})"]
    return problems


def _break_line(run: str, seq: Any, said: str) -> str:
    return (
        f"digest: run {run} at seq {seq}: the transition does not match its digest"
        " (changed since it was written)" + said
    )


def verifier(
    conn: sqlite3.Connection, chains: list[tuple[str, str]]
) -> Callable[[Sequence[str], Sequence[Sequence[Any]]], None]:
    """:func:`row_breaks` into ``chains``, given the journal's migration (``_range_reads``)."""
    return functools.partial(row_breaks, chains, migrated(conn))


def row_breaks(
    chains: list[tuple[str, str]],
    migrated_to: tuple[str, int] | None,
    names: Sequence[str],
    rows: Sequence[Sequence[Any]],
) -> None:
    """Verify the hash chains of transitions as a check reads them (all their columns).

    ``rows``: by run key then seq, each with the columns ``names`` (text as stored: a text
    column that is not UTF-8 fails the read, as a missing column does here: the check then
    reads run by run, and verifies the chains in its medium's checks). Each run
    whose chain breaks is added to ``chains`` as (its id, the line :func:`chain_problems`
    gives). ~1 us a transition: the digest of values of the types a step writes.
    """
    if "digest" not in names:
        return  # a journal without digests (one migrated only as far as it is read)
    at = {name: index for index, name in enumerate(names)}
    missing = {*TRANSITION_DIGEST_COLUMNS, "run_key"} - at.keys()
    if missing:  # a damaged table: the check reads it run by run (the medium says why)
        raise JournalError(f"transitions has no column {', '.join(sorted(missing))}")
    pick = operator.itemgetter(*[at[column] for column in TRANSITION_DIGEST_COLUMNS])
    key_at, seq_at, run_at, digest_at = at["run_key"], at["seq"], at["run_id"], at["digest"]
    last_key: Any = None
    previous: str | None = None
    broken = False
    for row in rows:
        key = row[key_at]
        if key != last_key:
            last_key, previous, broken = key, None, False
        elif broken:
            continue
        stored = row[digest_at]
        expected = step_digest(previous, *pick(row))
        if stored != expected:
            broken = True
            run = _shown_id(row[run_at])
            chains.append(
                (str(row[run_at]), _break_line(run, row[seq_at], origin(key, migrated_to)))
            )
        previous = stored if isinstance(stored, str) else expected


def _row_problems(conn: sqlite3.Connection, migrated_to: tuple[str, int] | None) -> list[str]:
    """The run rows, iterations, effects and artifacts that do not match their own digest."""
    problems = []
    select = _select(conn, "run_rows", RUN_DIGEST_COLUMNS)
    for key, run_id, stored, *values in conn.execute(
        f"SELECT run_key, run_id, digest, {select} FROM run_rows ORDER BY run_key"
    ):
        if stored != stored_row_digest(values):
            problems.append(
                f"digest: run {_shown_id(run_id)}: its row (input, context, error) does not match"
                " its digest"
                " (changed since it was written)" + origin(key, migrated_to)
            )
    for table, columns, named in _ROW_TABLES:
        names = _ROW_KEYS[table]
        rows = conn.execute(
            f"SELECT r.run_key, {', '.join('t.' + n for n in names)}, t.digest,"
            f" {_select(conn, table, columns, 't.')}"
            f" FROM {table} AS t LEFT JOIN run_rows AS r ON r.run_id = t.run_id"
            " ORDER BY t.rowid"
        )
        for key, *rest in rows:
            ids, stored, values = rest[: len(names)], rest[len(names)], rest[len(names) + 1 :]
            if stored != row_digest(values):
                problems.append(
                    f"digest: run {_shown_id(ids[0])}: its {named.format(*ids)} does not match its"
                    " digest (changed since it was written)" + origin(key, migrated_to)
                )
    return problems


def _name(names: dict[int, str], key: int) -> str:
    """How a problem line names the run of ``key``: its id, escaped if it breaks the rule."""
    return _shown_id(names[key]) if key in names else f"with run_key {key}"


def _shown_id(run_id: Any) -> str:
    return shown(run_id) if isinstance(run_id, str) else repr(run_id)


def _run_names(conn: sqlite3.Connection) -> dict[int, str]:
    return dict(conn.execute("SELECT run_key, run_id FROM run_rows"))


def migrated(conn: sqlite3.Connection) -> tuple[str, int] | None:
    """When a migration computed the digests of the runs it found, and up to which run key."""
    found = dict(
        conn.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (MIGRATED, MIGRATED_KEYS))
    )
    with contextlib.suppress(KeyError, ValueError):
        return str(found[MIGRATED]), int(found[MIGRATED_KEYS])
    return None


def origin(key: Any, migrated_to: tuple[str, int] | None) -> str:
    """What a digest vouches for, when a migration computed it (else nothing to add)."""
    if migrated_to is None or not isinstance(key, int) or key > migrated_to[1]:
        return ""
    return f"; its digests were {migrated_to[0]}: they vouch only for what the migration read"
