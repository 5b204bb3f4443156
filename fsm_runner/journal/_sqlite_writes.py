"""SQLite's fenced writes: the commit of a step (the hot path), of a group, of new runs; forks.

:class:`SqliteWriter` is the object :class:`~fsm_runner.journal.sqlite.SqliteJournal` holds for
its writes, over the journal's :class:`~._sqlite_connections.SqliteConnections`; the journal
binds the writer's :meth:`~SqliteWriter.commit`, :meth:`~SqliteWriter.commit_many` and
:meth:`~SqliteWriter.create_runs` as its own, so a step makes no call through the journal. The
hot-path commit is prepared SQL on the raw connection (never sqlite-utils): in the common step
one autocommit INSERT of the transition, which the ``transitions_fence`` trigger admits only at
the run's next seq and under its current lease token. Every call or indirection added to
:meth:`SqliteWriter.commit` or :meth:`SqliteWriter.commit_many` costs every step: measure
(``tests/bench``) before adding one.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sqlite3
from collections.abc import Sequence
from typing import Any

import attrs

from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import JournalError, RunConflictError, RunNotFoundError
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._digest import step_digest, transition_digest
from fsm_runner.journal._sql import SqlCore
from fsm_runner.journal._sqlite_chain import (
    fill_digests,
    row_with_digest,
    run_digest,
    stored_digest,
    with_digest,
)
from fsm_runner.journal._sqlite_connections import SqliteConnections
from fsm_runner.journal._sqlite_errors import STALE_SEQ, describe, errors, refused_if_exists
from fsm_runner.journal._sqlite_inserts import LIMIT_VARIABLE_NUMBER, insert_row, insert_rows
from fsm_runner.journal.base import Commit, NewRun, new_runs
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    format_utc,
    utc_now,
)
from fsm_runner.run_ids import check_run_id, check_run_ids
from fsm_runner.spec import RunLifecycle

__all__ = ["PUT_EFFECT", "SqliteWriter"]

_EFFECT_COLUMNS = _rows.EFFECT_COLUMNS
#: The dialect's INSERT (or replace) of an effect (see :class:`~._sql.SqlDialect`).
PUT_EFFECT = (
    f"INSERT OR REPLACE INTO effects ({', '.join(_EFFECT_COLUMNS)}, digest)"
    f" SELECT {', '.join('?' * (len(_EFFECT_COLUMNS) + 1))}"
    " WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = ? AND seq = ?"
    " AND (? IS NULL OR lease_token = ?))"
)
_ITERATION_COLUMNS = _rows.ITERATION_COLUMNS
# Each of these rows carries a digest of its values (schema 11): the last parameter.
_UPSERT_ITERATION = (
    f"INSERT OR REPLACE INTO iterations ({', '.join(_ITERATION_COLUMNS)}, digest)"
    f" VALUES ({', '.join('?' * (len(_ITERATION_COLUMNS) + 1))})"
)
_ARTIFACT_COLUMNS = _rows.ARTIFACT_COLUMNS
_UPSERT_ARTIFACT = (
    f"INSERT OR REPLACE INTO artifacts ({', '.join(_ARTIFACT_COLUMNS)}, digest)"
    f" VALUES ({', '.join('?' * (len(_ARTIFACT_COLUMNS) + 1))})"
)

#: How many runs' last written rows the journal remembers to write only changed columns.
_REMEMBERED_RUNS = 10_000
#: One transition's VALUES. Its ``result`` is bound as :data:`_NO_RESULT` when it has none:
#: ``sqlite3`` binds an ``int`` at once, but looks for an adapter of ``None`` (and formats the
#: ``AttributeError`` of its ``__conform__``) every time, ~3k instructions a parameter. A
#: stored result is JSON text, never that integer, so ``NULLIF`` turns only it into NULL (and
#: a ``None`` still binds as NULL). Its last value is its digest, chained to the run's
#: previous transition's (schema 11: see :mod:`~fsm_runner.journal._digest`).
_TRANSITION_VALUES = "(?, ?, ?, ?, ?, ?, ?, ?, ?, NULLIF(?, 0), ?, ?, ?)"
_NO_RESULT = 0
_INSERT_TRANSITION = (
    "INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,"
    f" duration_ms, result, lease_token, run_key, digest) VALUES {_TRANSITION_VALUES}"
)
_TRANSITION_PARAMS = 13
_run_key_of = operator.itemgetter(11)  # an INSERT's (run_key, seq) order
_BULK_ROWS = 256  # rows per multi-row INSERT, at most (13 parameters each)
#: How many run ids' keys (``run_rows.run_key``) the journal remembers; a miss costs one lookup.
_REMEMBERED_KEYS = 100_000


@functools.lru_cache(maxsize=64)
def _bulk_insert(rows: int) -> str:
    """The INSERT of ``rows`` transitions in one statement."""
    values = ", ".join([_TRANSITION_VALUES] * rows)
    return _INSERT_TRANSITION.split(" VALUES ", maxsplit=1)[0] + " VALUES " + values


#: A pending signal of the run (by its key) marked consumed by a transition (seq, at).
_CONSUME_SIGNAL = (
    "UPDATE signals SET consumed_seq = ?, consumed_at = ?"
    " WHERE number = ? AND run_key = ? AND consumed_seq IS NULL"
)

#: The run row's columns as SQLite inserts them: with its digest (schema 11), last.
_RUN_COLUMNS = (*_rows.RUN_COLUMNS, "digest")


_INSERT_RUN = (
    f"INSERT INTO run_rows ({', '.join(_RUN_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(_RUN_COLUMNS))})"
)


_dumps = _rows.dumps


#: Set to NULL when the run ends: its lease holder (its token stays) and its wake time (an
#: ended run is never due: schema version 10).
_ENDED_NULLS = ("lease_owner", "lease_expires_at", "wake_at")
#: A run's status while it has not ended.
_ACTIVE = RunLifecycle.ACTIVE


def _update_run_row(columns: Sequence[str], bound: int) -> str:
    """The UPDATE of a run row (found by its ``run_key``) that sets ``columns``.

    The first ``bound`` columns take parameters; the others are set to NULL in the SQL itself
    (see :data:`_TRANSITION_VALUES`).
    """
    assignments = ", ".join(
        f"{column} = {'?' if index < bound else 'NULL'}" for index, column in enumerate(columns)
    )
    return f"UPDATE run_rows SET {assignments} WHERE run_key = ?"


#: The UPDATE :func:`_row_update` writes when a plain step ends a run: the
#: head, the status, no lease holder and no wake time.
_END_RUN = _update_run_row(
    ("state", "seq", "iteration", "updated_at", "visit_seq", "status", *_ENDED_NULLS), 6
)


def _inserted_key(cursor: sqlite3.Cursor) -> int:
    """The ``run_key`` SQLite gave the run row ``cursor`` just inserted."""
    key = cursor.lastrowid
    if key is None:  # pragma: no cover - SQLite sets it after every successful INSERT
        raise JournalError("gave no run_key to a new run row")
    return key


_INSERT_SPEC = (
    "INSERT OR IGNORE INTO specs (spec_hash, machine, json, created_at) VALUES (?, ?, ?, ?)"
)
#: A new run row with its ``run_key`` given (the last parameter): see ``create_runs``.
_INSERT_KEYED_RUN = (
    f"INSERT INTO run_rows ({', '.join(_RUN_COLUMNS)}, run_key)"
    f" VALUES ({', '.join('?' * (len(_RUN_COLUMNS) + 1))})"
)


def _insert_runs(cursor: sqlite3.Cursor, rows: Sequence[tuple[Any, ...]]) -> range:
    """Insert new run rows (inside a write transaction), in order; return their keys.

    The first row's key is SQLite's (AUTOINCREMENT); the write lock held, the next ones are
    those it would give next, one more each, given with the rows: no round trip per row.
    """
    insert_row(cursor, _INSERT_RUN, rows[0])
    first = _inserted_key(cursor)
    keys = range(first, first + len(rows))
    keyed = [(*row, key) for row, key in zip(rows[1:], keys[1:], strict=True)]
    insert_rows(cursor, _INSERT_KEYED_RUN, keyed)
    return keys


#: One commit of a group, planned: its index in the group, its INSERT's parameters and the
#: other statements that go with it (``None``: the INSERT is the whole commit).
_Planned = tuple[int, tuple[Any, ...], list[tuple[str, tuple[Any, ...]]] | None]


def _apply_group(cursor: sqlite3.Cursor, planned: Sequence[_Planned], per_statement: int) -> None:
    """Every statement of a group of distinct runs' commits (inside its transaction).

    The transitions first (:func:`_insert_many`), then the other statements, one
    ``executemany`` per distinct SQL in the order each first appears.
    """
    _insert_many(cursor, [insert for _, insert, _ in planned], per_statement)
    others: dict[str, list[tuple[Any, ...]]] = {}
    for _, _, rows in planned:
        if rows is not None:
            for sql, params in rows:
                same = others.get(sql)
                if same is None:
                    others[sql] = [params]
                else:
                    same.append(params)
    for sql, params_list in others.items():
        cursor.executemany(sql, params_list)


def _insert_many(
    cursor: sqlite3.Cursor, inserts: Sequence[tuple[Any, ...]], per_statement: int
) -> None:
    """INSERT many transitions (of distinct runs) in as few statements as the parameters allow.

    One multi-row VALUES statement binds the whole group and steps once: one call, instead
    of one per row, and SQLite releases the GIL for the whole of it. The rows go in the
    order of the ``(run_key, seq)`` index, so each insert lands next to the one before
    instead of in a random leaf: half the cost of a row at 1,000 runs (bench_concurrent).
    """
    inserts = sorted(inserts, key=_run_key_of)
    for start in range(0, len(inserts), per_statement):
        chunk = inserts[start : start + per_statement]
        cursor.execute(_bulk_insert(len(chunk)), list(itertools.chain.from_iterable(chunk)))


def _row_update(
    known: RunRecord | None,
    update_sql: dict[tuple[str, ...], str],
    run: RunRecord,
    transition: TransitionRecord,
    *,
    at: str,
    key: int,
) -> tuple[str, tuple[Any, ...]]:
    """The UPDATE of the stored run row, when more than the run's head changed.

    ``known``: the row as this journal last wrote or read it. Called off the hot path only:
    :meth:`SqliteWriter._statements` has found that more than the head
    changed, or that this journal does not know the row as stored at ``seq - 1``.

    The head (state, seq, iteration, updated_at and a new visit) is the last transition, read
    through the ``runs`` view, so a plain step writes no run row at all. Any other change
    writes the head into the row too (the view then reads the row's own updated_at and
    visit_seq). Every column assigned costs (the status index alone ~8 µs a step), so when
    this journal knows the row as stored at ``seq - 1`` it leaves unchanged columns alone.
    That knowledge is safe: the fence trigger refuses the commit unless the run is at
    ``seq - 1``. ``at`` is the transition's time as the INSERT writes it: the row's
    ``updated_at`` when it was the transition's (the engine's rows), formatted once.

    The row is found by ``key``, its ``run_key`` (the rowid: no lookup in the ``run_id``
    index). It runs only after the transition's INSERT in the same transaction, which the
    fence trigger admits only with the ``run_key`` of that very ``run_id``.
    """
    if known is not None and known.seq != transition.seq - 1:
        known = None
    columns = ["state", "seq", "iteration", "updated_at", "visit_seq"]
    params: list[Any] = [
        run.state,
        run.seq,
        run.iteration,
        at if run.updated_at is transition.at else format_utc(run.updated_at),
        run.visit_seq,
    ]
    if known is None or run.status is not known.status:
        columns.append("status")
        params.append(run.status.value)
    if known is None or run.attempt != known.attempt:
        columns.append("attempt")
        params.append(run.attempt)
    if known is None or run.context is not known.context or run.error is not known.error:
        # Rewritten with the row's digest (schema 11), which covers them
        context, error = _dumps(run.context), _dumps(run.error)
        columns += ["context", "error", "digest"]
        params += [context, error, run_digest(run, context, error)]
    if known is None or (run.return_to, run.return_attempt) != (
        known.return_to,
        known.return_attempt,
    ):
        columns += ["return_to", "return_attempt", "return_visit"]
        params += [run.return_to, run.return_attempt, run.return_visit]
    # Columns set to NULL are written as NULL in the SQL, not bound (see _TRANSITION_VALUES).
    if transition.event == USER_ABORTED:
        columns += ["abort_reason", "abort_token"]  # the abort carried out clears the request
    if run.ended:
        # The run ends: its lease ends with it (the token stays, as a release leaves it),
        # and so does its wake time.
        columns += _ENDED_NULLS
    names = tuple(columns)
    sql = update_sql.get(names)
    if sql is None:
        sql = update_sql[names] = _update_run_row(names, len(params))
    params.append(key)
    return sql, tuple(params)


class SqliteWriter:
    """The fenced writes of one SQLite journal, and what it remembers of the rows it wrote.

    Args:
        connections: the journal's connection manager.
        core: the journal's shared SQL (row parameters, refusals).
    """

    def __init__(self, connections: SqliteConnections, core: SqlCore) -> None:
        self._connections = connections
        self._core = core
        #: Run rows as last written or read here: a commit writes only the columns it changes.
        self._written: dict[str, RunRecord] = {}
        #: Run id -> ``run_rows.run_key``, as read or written here.
        self._keys: dict[str, int] = {}
        #: Run id -> (seq, digest) of the run's last transition written here (its head when
        #: the next commit is at seq + 1): a step reads no digest to chain its own to.
        self._heads: dict[str, tuple[int, str]] = {}
        self._update_sql: dict[tuple[str, ...], str] = {}
        getlimit = getattr(connections.conn, "getlimit", None)  # Python 3.11+
        variables = getlimit(LIMIT_VARIABLE_NUMBER) if getlimit else 999
        self._bulk_rows = max(1, min(_BULK_ROWS, variables // _TRANSITION_PARAMS))

    def create_runs(self, runs: Sequence[NewRun], *, spec_json: str) -> None:
        """Store new runs, each with its transition seq 0 and iterations, in ONE transaction.

        All or nothing: a run whose id exists refuses the whole batch (``RunExistsError``
        naming the first such run). Every run is under the one spec ``spec_json`` holds.

        Past the first run, the run keys are given here (:func:`_insert_runs`), so each
        table's rows go in by one ``executemany``: no round trip per run for its key.
        """
        check_run_ids([run.run_id for run, _, _ in runs])
        if not new_runs(runs):
            return
        core = self._core
        run_rows = [with_digest(core.run_params(run)) for run, _, _ in runs]
        transition_rows = [core.transition_params(first) for _, first, _ in runs]
        digests = [transition_digest(None, row) for row in transition_rows]
        iteration_rows = [
            row_with_digest(core.iteration_params(i)) for _, _, opened in runs for i in opened
        ]
        spec = (runs[0][0].spec_hash, runs[0][0].machine, spec_json, format_utc(utc_now()))
        refused = runs[0][0].run_id
        try:
            with self._connections.write() as conn:
                cursor = conn.cursor()
                cursor.execute(_INSERT_SPEC, spec)
                before = conn.total_changes
                try:
                    keys = _insert_runs(cursor, run_rows)
                except sqlite3.IntegrityError:  # the rows before the refused one are in
                    refused = runs[conn.total_changes - before][0].run_id
                    raise
                insert_rows(
                    cursor,
                    _INSERT_TRANSITION,
                    [
                        (*row, key, digest)
                        for row, key, digest in zip(transition_rows, keys, digests, strict=True)
                    ],
                )
                if iteration_rows:
                    insert_rows(cursor, _UPSERT_ITERATION, iteration_rows)
        except JournalError as exc:
            with refused_if_exists(refused):
                raise exc from exc.__cause__
        self._remember_many([run for run, _, _ in runs], keys, digests)

    def commit(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        *,
        iterations: Sequence[IterationRecord] = (),
        artifacts: Sequence[ArtifactRecord] = (),
        spec_json: str | None = None,
    ) -> None:
        """Store ``transition`` and the run row it leads to, in one transaction.

        The run's head (state, seq, iteration, updated_at) is its last transition, and the
        ``transitions_fence`` trigger refuses a stale seq or lease token, so in the common
        step — nothing else about the run changed — the whole commit is one autocommit INSERT.
        Other changed columns are written by an UPDATE of ``run_rows`` in the same
        ``BEGIN IMMEDIATE`` transaction.
        """
        insert, rows = self._statements(run, transition, iterations, artifacts, spec_json)
        run_id = run.run_id
        written = self._written
        connections = self._connections
        with connections.lock:
            if connections.closed:
                raise JournalError("is closed", path=connections.path)
            if connections.unwritable is not None:
                raise JournalError(connections.unwritable, path=connections.path)
            cursor = connections.cursor  # reused: a new one per statement costs ~0.5 µs
            try:
                if rows is None:
                    cursor.execute(_INSERT_TRANSITION, insert)
                else:
                    self._commit_with_rows(cursor, insert, rows)
            except sqlite3.IntegrityError as exc:
                written.pop(run_id, None)
                raise self._refusal(
                    exc, run_id, transition.seq - 1, transition.lease_token
                ) from None
            except sqlite3.Error as exc:
                written.pop(run_id, None)
                raise JournalError(describe(exc, connections.path), path=connections.path) from exc
            if len(written) >= _REMEMBERED_RUNS:
                written.clear()
                self._heads.clear()
            written[run_id] = run
            self._heads[run_id] = (transition.seq, insert[12])

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """:meth:`commit` and mark signal ``number`` consumed by it, in ONE transaction.

        The commit's own statements (:meth:`_statements`), then :data:`_CONSUME_SIGNAL`, which
        changes the signal only while it is pending and the run's (by the key the fence admits
        the transition with). Refused as :meth:`commit` refuses, or ``RunConflictError`` when
        the signal is not pending: rolled back, nothing written.
        """
        insert, rows = self._statements(run, transition, (), (), None)
        consume = (_CONSUME_SIGNAL, (transition.seq, insert[7], number, insert[11]))
        self._written.pop(run.run_id, None)  # until it is stored
        with self._connections.write() as conn:
            cursor = conn.cursor()
            try:
                self._insert_with(cursor, insert, [*(rows or ()), consume])
            except sqlite3.IntegrityError as exc:
                seq, token = transition.seq - 1, transition.lease_token
                raise self._refusal(exc, run.run_id, seq, token) from None
            if not cursor.rowcount:  # consumed already (by a writer that moved the run on)
                path = self._connections.path
                raise RunConflictError(run_id=run.run_id, expected_seq=run.seq - 1, path=path)
        self.remember(run)
        self._heads[run.run_id] = (transition.seq, insert[12])

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one ``BEGIN IMMEDIATE`` transaction (see ``Journal``).

        A one-statement commit that is refused is undone by SQLite itself (the trigger's
        ``RAISE(ABORT)`` ends that statement only); one with more statements runs inside a
        SAVEPOINT, rolled back when it is refused.
        """
        results: list[Exception | None] = [None] * len(commits)
        planned = []
        heads: dict[str, tuple[int, str]] = {}  # a run's commit chains to its one before here
        for index, item in enumerate(commits):
            try:
                insert, rows = self._statements(
                    item.run, item.transition, item.iterations, item.artifacts, item.spec_json,
                    planned=heads,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001, PERF203 - refused alone, returned at its index
                results[index] = exc
            else:
                planned.append((index, insert, rows))
                heads[item.run.run_id] = (insert[1], insert[12])
        if not planned:
            return results
        stored: list[int] = []
        connections = self._connections
        with connections.lock:
            try:
                connections.check_writable()
                with errors(connections.path):
                    self._write_group(commits, planned, results, stored)
            except JournalError as failure:
                for index in stored:  # rolled back: neither row nor head is as remembered
                    self._written.pop(commits[index].run.run_id, None)
                    self._heads.pop(commits[index].run.run_id, None)
                return [failure if result is None else result for result in results]
            if len(self._written) >= _REMEMBERED_RUNS:
                self._written.clear()
                self._heads.clear()
        return results

    def _write_group(
        self,
        commits: Sequence[Commit],
        planned: Sequence[_Planned],
        results: list[Exception | None],
        stored: list[int],
    ) -> None:
        """The group's transaction: every commit at once where it can, else each on its own.

        A group of distinct runs goes in at once: all its transitions in multi-row INSERTs,
        then the other statements (the run-row UPDATEs of the runs that end, say) one
        ``executemany`` per distinct SQL, in the order each first appears. Commits of distinct
        runs touch distinct rows, so their order does not matter. If any of it is refused
        (``IntegrityError``), the transaction is rolled back and every commit is done again
        on its own, each with its statements in a SAVEPOINT: refused alone.
        """
        written, heads = self._written, self._heads
        cursor = self._connections.cursor
        cursor.execute("BEGIN IMMEDIATE")
        try:
            if len(planned) > 1 and len({commits[i].run.run_id for i, _, _ in planned}) == len(
                planned
            ):
                try:
                    _apply_group(cursor, planned, self._bulk_rows)
                except sqlite3.IntegrityError:  # one of them is refused: each on its own, below
                    cursor.execute("ROLLBACK")
                    cursor.execute("BEGIN IMMEDIATE")
                else:
                    for index, insert, _ in planned:
                        written[commits[index].run.run_id] = commits[index].run
                        heads[commits[index].run.run_id] = (insert[1], insert[12])
                        stored.append(index)
                    planned = ()
            for index, insert, rows in planned:
                run = commits[index].run
                try:
                    if rows is None:
                        cursor.execute(_INSERT_TRANSITION, insert)
                    else:
                        self._savepoint(cursor, insert, rows)
                except sqlite3.IntegrityError as exc:
                    written.pop(run.run_id, None)
                    results[index] = self._refusal(
                        exc, run.run_id, run.seq - 1, commits[index].transition.lease_token
                    )
                else:
                    written[run.run_id] = run  # known at this seq for a later commit here
                    heads[run.run_id] = (insert[1], insert[12])
                    stored.append(index)
            cursor.execute("COMMIT")
        except BaseException:
            if cursor.connection.in_transaction:
                cursor.execute("ROLLBACK")
            raise

    def _statements(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        iterations: Sequence[IterationRecord],
        artifacts: Sequence[ArtifactRecord],
        spec_json: str | None,
        *,
        planned: dict[str, tuple[int, str]] | None = None,
    ) -> tuple[tuple[Any, ...], list[tuple[str, tuple[Any, ...]]] | None]:
        """The INSERT of ``transition`` and, off the hot path, the other statements with it."""
        seq = transition.seq
        if run.seq != seq or run.state != transition.to_state or seq < 1:
            self._core.refuse_malformed(run, transition)
        insert = self._insert(transition, planned)
        extra: tuple[str, tuple[Any, ...]] | None
        known, sqls = self._written.get(run.run_id), self._update_sql
        if (
            known is not None  # a plain step: the transition is all that changed, ...
            and known.seq == seq - 1
            and run.visit_seq == seq
            and run.attempt == known.attempt
            and run.context is known.context
            and run.error is known.error
            and run.return_to == known.return_to
            and transition.event != USER_ABORTED
        ):
            if run.status is known.status:
                # the hot path; a run nobody holds has its row written too (what claims read)
                extra = None
                if run.lease_owner is None:
                    extra = _row_update(known, sqls, run, transition, at=insert[7], key=insert[11])
            elif run.status is not _ACTIVE and run.return_attempt == known.return_attempt:
                # ... but for the run's end: what _row_update writes then, built at once
                at = insert[7] if run.updated_at is transition.at else format_utc(run.updated_at)
                # _value_: the member's value as stored on it (.value is a Python property)
                status = run.status._value_
                extra = (_END_RUN, (run.state, seq, run.iteration, at, seq, status, insert[11]))
            else:
                extra = _row_update(
                    known, self._update_sql, run, transition, at=insert[7], key=insert[11]
                )
        else:
            extra = _row_update(
                known, self._update_sql, run, transition, at=insert[7], key=insert[11]
            )
        if extra is None and not iterations and not artifacts and spec_json is None:
            return insert, None
        rows = [extra] if extra is not None else []
        if spec_json is not None:
            rows += [
                (
                    "INSERT OR IGNORE INTO specs (spec_hash, machine, json, created_at)"
                    " VALUES (?, ?, ?, ?)",
                    (run.spec_hash, run.machine, spec_json, format_utc(utc_now())),
                ),
                ("UPDATE run_rows SET spec_hash = ? WHERE run_id = ?", (run.spec_hash, run.run_id)),
            ]
        core = self._core
        rows += [(_UPSERT_ITERATION, row_with_digest(core.iteration_params(i))) for i in iterations]
        rows += [(_UPSERT_ARTIFACT, row_with_digest(core.artifact_params(a))) for a in artifacts]
        return insert, rows

    def _insert(
        self, transition: TransitionRecord, planned: dict[str, tuple[int, str]] | None
    ) -> tuple[Any, ...]:
        """The parameters of ``transition``'s INSERT, its digest last.

        Chained to the run's previous one as written here (``planned``: a group's before it;
        :attr:`_heads`), else as stored (one read, off the hot path).
        """
        run_id, seq, at = transition.run_id, transition.seq, format_utc(transition.at)
        result = None if transition.result is None else _dumps(transition.result)
        key = self._keys.get(run_id) or self._run_key(run_id)
        head = (planned and planned.get(run_id)) or self._heads.get(run_id)
        if head is not None and head[0] == seq - 1:
            previous: str | None = head[1]
        else:  # a run this journal did not write last: its head as stored
            with self._connections.read() as conn:
                previous = stored_digest(conn, key, seq - 1)
        from_state, event, to_state = transition.from_state, transition.event, transition.to_state
        iteration, attempt, ms = transition.iteration, transition.attempt, transition.duration_ms
        token = transition.lease_token
        digest = step_digest(
            previous, run_id, seq, from_state, event, to_state, iteration, attempt, at, ms, result,
            token,
        )  # fmt: skip
        stored = _NO_RESULT if result is None else result
        return (
            run_id, seq, from_state, event, to_state, iteration, attempt, at, ms, stored, token,
            key, digest,
        )  # fmt: skip

    def _savepoint(
        self,
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        """One commit of several statements inside a group: all of them or none."""
        cursor.execute("SAVEPOINT one_commit")
        try:
            self._insert_with(cursor, insert, rows)
        except BaseException:
            cursor.execute("ROLLBACK TO one_commit")
            raise
        finally:
            cursor.execute("RELEASE one_commit")

    @staticmethod
    def _insert_with(
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        """The transition's INSERT, then the statements that go with it (inside a transaction)."""
        cursor.execute(_INSERT_TRANSITION, insert)
        for sql, params in rows:
            cursor.execute(sql, params)

    def _commit_with_rows(
        self,
        cursor: sqlite3.Cursor,
        insert: tuple[Any, ...],
        rows: Sequence[tuple[str, tuple[Any, ...]]],
    ) -> None:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            self._insert_with(cursor, insert, rows)
            cursor.execute("COMMIT")
        except BaseException:
            if cursor.connection.in_transaction:
                cursor.execute("ROLLBACK")
            raise

    def remember(self, run: RunRecord) -> None:
        """Remember ``run`` as stored (read or written here): its next commit writes less."""
        if len(self._written) >= _REMEMBERED_RUNS:
            self._written.clear()
        self._written[run.run_id] = run

    def forget(self, run_ids: Sequence[str]) -> None:
        """Forget what was remembered of these runs (pruned: their ids may come back)."""
        for run_id in run_ids:
            self._written.pop(run_id, None)
            self._keys.pop(run_id, None)
            self._heads.pop(run_id, None)

    def _remember_many(
        self, runs: Sequence[RunRecord], keys: Sequence[int], digests: Sequence[str]
    ) -> None:
        """:meth:`remember` and :meth:`remember_key` of new runs (caches cleared once, first)."""
        written, known, heads = self._written, self._keys, self._heads
        if len(written) + len(runs) > _REMEMBERED_RUNS:
            written.clear()
            heads.clear()
        if len(known) + len(runs) > _REMEMBERED_KEYS:
            known.clear()
            heads.clear()
        for run, key, digest in zip(runs, keys, digests, strict=True):
            written[run.run_id] = run
            known[run.run_id] = key
            heads[run.run_id] = (0, digest)

    def remember_key(self, run_id: str, key: int) -> None:
        """Remember the run's ``run_key`` (read or written here)."""
        keys = self._keys
        if len(keys) >= _REMEMBERED_KEYS:
            keys.clear()
            self._heads.clear()  # a head is remembered only with its run's key
        if keys.get(run_id) != key:  # another run under that id (pruned, made again)
            self._heads.pop(run_id, None)
        keys[run_id] = key

    def _run_key(self, run_id: str) -> int:
        """The run's ``run_key`` (when this journal has not read or written the run yet)."""
        with self._connections.read() as conn:
            key = self.stored_key(conn, run_id)
        self.remember_key(run_id, key)
        return key

    @staticmethod
    def stored_key(conn: sqlite3.Connection, run_id: str) -> int:
        """The run's ``run_key`` as stored (read on ``conn``).

        Raises:
            RunNotFoundError: there is no such run.
        """
        row = conn.execute("SELECT run_key FROM run_rows WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        if type(row[0]) is not int:  # a damaged index (or row) gave no key
            raise JournalError(
                f"run {run_id!r} has an unreadable key ({row[0]!r}); 'fsm-runner check' says"
                " what is damaged",
                path=conn.execute("PRAGMA database_list").fetchone()[2] or None,
            )
        return row[0]

    def _refusal(
        self, exc: sqlite3.IntegrityError, run_id: str, expected_seq: int, token: int
    ) -> Exception:
        """Why the fence trigger (or a constraint) refused a commit."""
        connections = self._connections
        if STALE_SEQ not in str(exc) and "transitions.run_key" not in str(exc):
            return JournalError(describe(exc, connections.path), path=connections.path)
        self._keys.pop(run_id, None)  # read again next time, in case it was not the run's
        self._heads.pop(run_id, None)  # and so is its head (a pruned run's id may come back)
        found = connections.conn.execute(
            "SELECT v.seq, v.lease_token, v.abort_reason, r.abort_token FROM runs AS v"
            " JOIN run_rows AS r ON r.run_key = v.run_key WHERE v.run_id = ?",
            (run_id,),
        ).fetchone()
        return _lease.commit_refusal(found, run_id, expected_seq, token, path=connections.path)

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        check_run_id(run.run_id)
        _rows.check_fork(run, at_seq)
        first = with_digest(self._core.run_params(attrs.evolve(run, seq=0)))
        with refused_if_exists(run.run_id), self._connections.write() as conn:
            found = conn.execute(
                "SELECT seq, run_key FROM runs WHERE run_id = ?", (source_run_id,)
            ).fetchone()
            if found is None:
                raise RunNotFoundError(source_run_id)
            _rows.check_fork_source(source_run_id, found[0], at_seq)
            key = _inserted_key(conn.execute(_INSERT_RUN, first))
            # In seq order: the fence trigger admits each on top of the one before.
            conn.execute(
                "INSERT INTO transitions (run_id, run_key, seq, from_state, event, to_state,"
                " iteration, attempt, at, duration_ms, result) SELECT ?, ?, seq, from_state,"
                " event, to_state, iteration, attempt, at, duration_ms, result"
                " FROM transitions WHERE run_key = ? AND seq <= ? ORDER BY seq",
                (run.run_id, key, found[1], at_seq),
            )
            assignments = ", ".join(f"{column} = ?" for column in _rows.RUN_COLUMNS[1:])
            conn.execute(
                f"UPDATE run_rows SET {assignments} WHERE run_id = ?",
                (*self._core.run_params(run)[1:], run.run_id),
            )  # its digest: computed below, from what it holds
            copies = (
                ("iterations", _rows.ITERATION_COLUMNS, "iteration <= ?", run.iteration),
                ("artifacts", _rows.ARTIFACT_COLUMNS, "seq <= ?", at_seq),
                ("effects", _rows.EFFECT_COLUMNS, "visit_seq < ?", run.visit_seq),
            )
            for table, columns, condition, bound in copies:
                rest = [column for column in columns if column != "run_id"]
                conn.execute(
                    f"INSERT INTO {table} (run_id, {', '.join(rest)})"
                    f" SELECT ?, {', '.join(rest)} FROM {table}"
                    f" WHERE run_id = ? AND {condition}",
                    (run.run_id, source_run_id, bound),
                )
            # The copies belong to another run (and hold no lease token): their digests are
            # the fork's own, chained from its seq 0.
            fill_digests(conn, run_key=key, run_id=run.run_id)
        self.remember(run)
        self.remember_key(run.run_id, key)
