"""PostgreSQL's writes: the connection, getting a lost one back, and the fenced commit.

:class:`PostgresWrites` is the part of :class:`~fsm_runner.journal.postgres.PostgresJournal`
that talks to the server (set up there): :meth:`PostgresWrites._call` runs every operation,
reconnecting with backoff and resolving writes whose outcome a lost connection left unknown;
the hot-path commit is one statement (a fenced ``UPDATE`` of the run row and the ``INSERT`` of
the transition from it) in autocommit mode.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import psycopg
from psycopg import errors as pg_errors
from psycopg import pq, sql

from fsm_runner import _fork
from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import (
    JournalError,
    LeaseError,
    RunConflictError,
    RunExistsError,
)
from fsm_runner.journal import _rows
from fsm_runner.journal._sql import SqlJournal
from fsm_runner.journal.base import Commit, NewRun, new_runs
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    utc_now,
)

__all__ = ["DEFAULT_RETRY_FOR", "PostgresWrites"]

T = TypeVar("T")
_Connection = psycopg.Connection[tuple[Any, ...]]

_RUN_COLUMNS = _rows.RUN_COLUMNS
_RUN_SELECT = ", ".join(_RUN_COLUMNS)
_INSERT_RUN = f"INSERT INTO runs ({_RUN_SELECT}) VALUES ({', '.join(['%s'] * len(_RUN_COLUMNS))})"
_TRANSITION_COLUMNS = _rows.TRANSITION_COLUMNS
_INSERT_TRANSITION = (
    f"INSERT INTO transitions ({', '.join(_TRANSITION_COLUMNS)})"
    f" VALUES ({', '.join(['%s'] * len(_TRANSITION_COLUMNS))})"
)
#: The hot path, one statement: move the run row from seq N-1 to N — only if it is at N-1 and
#: the writer holds its current lease token (fencing), and, when an abort was requested under
#: that token, only for the USER_ABORTED that carries it out — and insert transition N from it.
#: A transition that ends the run also ends its lease (owner and expiry; the token stays).
_COMMIT_TEMPLATE = """
WITH moved AS (
    UPDATE runs SET state = %s, seq = %s, iteration = %s, updated_at = %s, status = %s,
                    attempt = %s, context = %s, error = %s, return_to = %s, return_attempt = %s,
                    return_visit = %s, visit_seq = %s,
                    abort_reason = CASE WHEN %s THEN NULL ELSE abort_reason END,
                    abort_token = CASE WHEN %s THEN NULL ELSE abort_token END,
                    lease_owner = CASE WHEN %s THEN NULL ELSE lease_owner END,
                    lease_expires_at = CASE WHEN %s THEN NULL ELSE lease_expires_at END{spec}
     WHERE run_id = %s AND seq = %s AND lease_token = %s
       AND (abort_token IS NULL OR abort_token < lease_token OR %s)
    RETURNING run_id
)
INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,
                         duration_ms, result, lease_token)
SELECT run_id, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s FROM moved
"""
_COMMIT = _COMMIT_TEMPLATE.format(spec="")
_COMMIT_WITH_SPEC = _COMMIT_TEMPLATE.format(spec=", spec_hash = %s")
_INSERT_SPEC = (
    "INSERT INTO specs (spec_hash, machine, json, created_at) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (spec_hash) DO NOTHING"
)


def _upsert(table: str, columns: Sequence[str], *, also: str = "") -> str:
    """An INSERT of ``columns`` that updates the row keyed by the first two where there is one."""
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
        f" ON CONFLICT ({', '.join(columns[:2])}) DO UPDATE SET "
        + ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[2:])
        + also
    )


_UPSERT_ITERATION = _upsert("iterations", _rows.ITERATION_COLUMNS)
# A replaced artifact takes a new id, so artifacts stay ordered as committed (SQLite's REPLACE).
_UPSERT_ARTIFACT = _upsert("artifacts", _rows.ARTIFACT_COLUMNS, also=", id = DEFAULT")


def _existing(exc: pg_errors.UniqueViolation, runs: Sequence[NewRun]) -> str:
    """The id of the run that already exists, from the server's detail, else the first one's."""
    detail = exc.diag.message_detail or ""
    for run, _, _ in runs:
        if f"=({run.run_id})" in detail:
            return run.run_id
    return runs[0][0].run_id


class _RefusedError(Exception):
    """A commit inside a transaction was refused: leave the transaction, rolling it back."""


class _Unresolved:
    """What a resolver returns when the interrupted write left nothing: do it again."""


_UNRESOLVED = _Unresolved()
#: Refusals that a write done again may meet because its first try did commit after all.
_REFUSALS = (RunConflictError, LeaseError, RunExistsError)


_dumps = _rows.dumps
_UTC = dt.timezone.utc
#: Seconds a write waits for a lost connection to come back before giving up.
DEFAULT_RETRY_FOR = 15.0
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    """A datetime as PostgreSQL should store it: naive datetimes are taken as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=_UTC)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


@attrs.frozen
class _CommitPlan:
    """One commit's statements: what :meth:`PostgresJournal.commit` runs, alone or in a group."""

    journal: PostgresWrites
    transition: TransitionRecord
    statement: str
    params: Sequence[Any]
    before: Sequence[tuple[str, Sequence[Any]]]
    after: Sequence[tuple[str, Sequence[Any]]]

    @property
    def simple(self) -> bool:
        """Whether the commit is one statement (the hot path)."""
        return not self.before and not self.after

    def apply(self, conn: _Connection) -> bool:
        """Run the statements; ``False`` when the commit was refused (the caller rolls back)."""
        for text, values in self.before:
            conn.execute(text, values)
        try:
            moved = conn.execute(self.statement, self.params).rowcount
        except pg_errors.UniqueViolation as exc:
            if exc.diag.constraint_name != "transitions_pkey":
                raise
            return False  # a transition at that seq exists: another writer was first
        if moved != 1:
            return False
        for text, values in self.after:
            conn.execute(text, values)
        return True

    def apply_or_raise(self, conn: _Connection) -> None:
        """Run the statements; raise :class:`_RefusedError` when the commit was refused."""
        if not self.apply(conn):
            raise _RefusedError

    def refusal(self, conn: _Connection) -> Exception:
        """Why the commit was refused (asked once its statements are rolled back)."""
        transition = self.transition
        found = conn.execute(
            "SELECT seq, lease_token, abort_reason, abort_token FROM runs WHERE run_id = %s",
            (transition.run_id,),
        ).fetchone()
        return self.journal._commit_refusal(
            found, transition.run_id, transition.seq - 1, transition.lease_token
        )

    def resolve(self, conn: _Connection) -> _Unresolved | None:
        """``None`` when this very transition is stored (a cut-off try did commit it)."""
        transition = self.transition
        row = conn.execute(
            "SELECT lease_token, at, event, to_state FROM transitions"
            " WHERE run_id = %s AND seq = %s",
            (transition.run_id, transition.seq),
        ).fetchone()
        expected = (
            transition.lease_token,
            _utc(transition.at),
            transition.event,
            transition.to_state,
        )
        return None if row is not None and tuple(row) == expected else _UNRESOLVED


class PostgresWrites(SqlJournal):
    """The connection and the writes of :class:`~fsm_runner.journal.postgres.PostgresJournal`."""

    schema: str
    retry_for: float
    _location: str
    _secrets: tuple[str, ...]
    _conninfo: str
    _connect_options: dict[str, Any]
    _conn: _Connection | None

    # -- connecting ----------------------------------------------------------------------------

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own, and a connection made at its first call.

        The parent's connection shares its socket with the parent: it is kept, never used nor
        closed here (closing it would end the parent's session). See :mod:`fsm_runner._fork`.
        """
        self._lock = threading.RLock()
        if self._conn is not None:
            _fork.keep(self._conn)
            self._conn = None

    def _connect(self, *, timeout: float | None = None) -> _Connection:
        options = dict(self._connect_options)
        if timeout is not None and "connect_timeout" in options:
            options["connect_timeout"] = max(2, min(10, round(timeout)))
        conn = psycopg.connect(self._conninfo, autocommit=True, **options)
        try:
            conn.execute(
                sql.SQL(
                    "SET search_path TO {}; SET TIME ZONE 'UTC'; SET synchronous_commit TO on"
                ).format(sql.Identifier(self.schema))
            )
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _connection(self, deadline: float | None) -> _Connection:
        if self._closed:
            raise JournalError("is closed", path=self._location)
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            self._conn = None
        remaining = None if deadline is None else deadline - time.monotonic()
        return self._connect(timeout=remaining)

    # -- calling the database ------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _describe(self, exc: BaseException) -> str:
        return self._scrub(_first_line(exc))

    def _call(
        self,
        work: Callable[[_Connection], T],
        *,
        resolve: Callable[[_Connection], T | _Unresolved] | None = None,
    ) -> T:
        """Run ``work`` on the connection, getting a lost connection back and trying again.

        ``resolve`` tells, after a try whose outcome is unknown (the connection died while it
        ran), whether that try committed after all — then its answer is returned instead of
        doing the work again.
        """
        deadline: float | None = None
        unknown = False
        backoff = _FIRST_BACKOFF
        while True:
            with self._lock:
                started = False
                try:
                    conn = self._connection(deadline)
                    if unknown and resolve is not None:
                        found = resolve(conn)
                        if not isinstance(found, _Unresolved):
                            return found
                    started = True
                    try:
                        return work(conn)
                    except _REFUSALS:
                        if not (unknown and resolve is not None):
                            raise
                        found = resolve(conn)  # a slow first try may have committed meanwhile
                        if not isinstance(found, _Unresolved):
                            return found
                        raise
                except psycopg.OperationalError as exc:
                    if not self._transient(exc):
                        raise JournalError(self._describe(exc), path=self._location) from None
                    unknown = unknown or started
                    last = self._describe(exc)
                except psycopg.Error as exc:
                    raise JournalError(self._describe(exc), path=self._location) from None
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.retry_for
            if now >= deadline:
                outcome = "; whether the last write was committed is unknown" if unknown else ""
                raise JournalError(
                    f"lost its connection to PostgreSQL and could not get it back within "
                    f"{self.retry_for:g} s ({last}){outcome}",
                    path=self._location,
                )
            jitter = 0.5 + random.random()  # noqa: S311 - spreads reconnects, not a secret
            time.sleep(min(backoff * jitter, max(0.0, deadline - now)))
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _transient(self, exc: psycopg.OperationalError) -> bool:
        """A lost connection (or a failed reconnect), a deadlock or a serialization failure."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return True
        if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF:
            # Cut off inside a pipeline (``executemany``): psycopg could not leave pipeline mode
            # and did not mark the connection broken, yet no statement can run on it again.
            self._disconnect()
            return True
        return isinstance(exc, pg_errors.TransactionRollback)

    # -- writes --------------------------------------------------------------------------------

    def create_run(
        self,
        run: RunRecord,
        first: TransitionRecord,
        *,
        spec_json: str,
        iterations: Sequence[IterationRecord] = (),
    ) -> None:
        """Store a new run with its transition seq 0, spec and iterations, in one transaction."""
        self.create_runs([(run, first, iterations)], spec_json=spec_json)

    def create_runs(self, runs: Sequence[NewRun], *, spec_json: str) -> None:
        """Store new runs, each with its transition seq 0 and iterations, in ONE transaction.

        All or nothing: a run whose id exists refuses the whole batch (``RunExistsError``).
        """
        if not new_runs(runs):
            return
        run_rows = [self._run_params(run) for run, _, _ in runs]
        transition_rows = [self._transition_params(first) for _, first, _ in runs]
        iteration_rows = [
            self._iteration_params(record) for _, _, iterations in runs for record in iterations
        ]
        last, last_first = runs[-1][0], runs[-1][1]
        spec_row = (last.spec_hash, last.machine, spec_json, utc_now())

        def work(conn: _Connection) -> None:
            try:
                with conn.transaction(), conn.cursor() as cursor:
                    cursor.execute(_INSERT_SPEC, spec_row)
                    cursor.executemany(_INSERT_RUN, run_rows)
                    cursor.executemany(_INSERT_TRANSITION, transition_rows)
                    if iteration_rows:
                        cursor.executemany(_UPSERT_ITERATION, iteration_rows)
            except pg_errors.UniqueViolation as exc:
                if exc.diag.constraint_name == "runs_pkey":
                    raise RunExistsError(_existing(exc, runs)) from None
                raise

        def resolve(conn: _Connection) -> _Unresolved | None:
            # One transaction: the batch is stored if its last run is, as written.
            row = conn.execute(
                "SELECT r.created_at, t.at, t.event FROM runs AS r JOIN transitions AS t"
                " ON t.run_id = r.run_id AND t.seq = 0 WHERE r.run_id = %s",
                (last.run_id,),
            ).fetchone()
            if row is not None and (row[0], row[1], row[2]) == (
                _utc(last.created_at),
                _utc(last_first.at),
                last_first.event,
            ):
                return None
            return _UNRESOLVED

        self._call(work, resolve=resolve)

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

        The run row moves from ``seq - 1`` to ``seq`` only if it is at ``seq - 1`` and carries
        the transition's lease token; the transition is inserted from that UPDATE, in the same
        statement. Without iterations, artifacts or a spec change that statement is the whole
        commit.
        """
        plan = self._plan(run, transition, iterations, artifacts, spec_json)

        def work(conn: _Connection) -> None:
            if plan.simple:  # the hot path: one statement, one transaction
                if not plan.apply(conn):
                    raise plan.refusal(conn)
                return
            try:
                with conn.transaction():
                    plan.apply_or_raise(conn)
            except _RefusedError:  # and rolled back: nothing of it was written
                raise plan.refusal(conn) from None

        self._call(work, resolve=plan.resolve)

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one transaction (see :meth:`Journal.commit_many`).

        Each commit runs in a savepoint of its own, rolled back when it is refused. After a
        lost connection the group is done again; a commit refused then because the cut-off try
        did store it (its transition is there, with its lease token, time and event) counts as
        stored.
        """
        results: list[Exception | None] = [None] * len(commits)
        plans: list[tuple[int, _CommitPlan]] = []
        for index, item in enumerate(commits):
            try:
                plan = self._plan(
                    item.run, item.transition, item.iterations, item.artifacts, item.spec_json
                )
            except Exception as exc:  # noqa: BLE001, PERF203 - a malformed commit is refused alone
                results[index] = exc
            else:
                plans.append((index, plan))
        if not plans:
            return results
        tries = 0

        def work(conn: _Connection) -> dict[int, Exception]:
            nonlocal tries
            tries += 1
            refused: dict[int, Exception] = {}
            with conn.transaction():
                for index, plan in plans:
                    conn.execute("SAVEPOINT one_commit")
                    if plan.apply(conn):
                        conn.execute("RELEASE SAVEPOINT one_commit")
                        continue
                    conn.execute("ROLLBACK TO SAVEPOINT one_commit")
                    if tries > 1 and not isinstance(plan.resolve(conn), _Unresolved):
                        continue  # stored by the try that was cut off
                    refused[index] = plan.refusal(conn)
            return refused

        try:
            refused = self._call(work)
        except JournalError as failure:
            return [failure if result is None else result for result in results]
        for index, refusal in refused.items():
            results[index] = refusal
        return results

    def _plan(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        iterations: Sequence[IterationRecord],
        artifacts: Sequence[ArtifactRecord],
        spec_json: str | None,
    ) -> _CommitPlan:
        """The statements of one commit (checked, and its payloads serialised, up front)."""
        seq = transition.seq
        if run.seq != seq or run.state != transition.to_state or seq < 1:
            self._refuse_malformed(run, transition)
        aborting = transition.event == USER_ABORTED
        params: list[Any] = [
            transition.to_state,
            seq,
            transition.iteration,
            _utc(transition.at),
            run.status.value,
            run.attempt,
            _dumps(run.context),
            _dumps(run.error),
            run.return_to,
            run.return_attempt,
            run.return_visit,
            run.visit_seq,
            aborting,  # the abort carried out clears the request ...
            aborting,
            run.ended,  # a run that ends lets go of its lease (its token stays)
            run.ended,
        ]
        before: list[tuple[str, Sequence[Any]]] = []
        if spec_json is not None:
            params.append(run.spec_hash)
            before.append((_INSERT_SPEC, (run.spec_hash, run.machine, spec_json, utc_now())))
        # ... and is the one transition taken under the token its abort was requested under
        params += [run.run_id, seq - 1, transition.lease_token, aborting]
        params += self._transition_params(transition)[1:]
        after = [(_UPSERT_ITERATION, self._iteration_params(i)) for i in iterations]
        after += [(_UPSERT_ARTIFACT, self._artifact_params(a)) for a in artifacts]
        return _CommitPlan(
            journal=self,
            transition=transition,
            statement=_COMMIT if spec_json is None else _COMMIT_WITH_SPEC,
            params=params,
            before=before,
            after=after,
        )
