"""PostgreSQL's fenced writes: the commit of a step (the hot path), of a group, of new runs.

:class:`PostgresWriter` is the object :class:`~fsm_runner.journal.postgres.PostgresJournal`
holds for them, over the journal's
:class:`~fsm_runner.journal._postgres_connection.PostgresConnection` (which runs each one,
getting a lost connection back and asking a write cut off whether it committed); the journal
binds the writer's ``commit``, ``commit_many`` and ``create_runs`` as its own. The hot-path
commit is one statement (a fenced ``UPDATE`` of the run row and the ``INSERT`` of the
transition from it) in autocommit mode.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import attrs
from psycopg import errors as pg_errors

from fsm_runner.events import USER_ABORTED
from fsm_runner.exceptions import (
    JournalError,
    RunConflictError,
    RunExistsError,
    RunNotFoundError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._digest import row_digest_from
from fsm_runner.journal._postgres_chain import (
    fill_digests,
    own_digest,
    run_digest,
    run_hasher,
    transition_chain_digest,
)
from fsm_runner.journal._postgres_connection import (
    UNRESOLVED,
    Connection,
    PostgresConnection,
    Unresolved,
    reused_cursor,
)
from fsm_runner.journal._postgres_groups import (
    BULK_START,
    BULK_STARTS,
    COMMIT_PARAMS,
    INSERT_SPEC,
    ONE_STATEMENT_STARTS,
    STORED_RUN_COLUMNS,
    STORED_TRANSITION_COLUMNS,
    bulk_start_params,
    group_statement,
    start_statement,
)
from fsm_runner.journal._sql import SqlCore
from fsm_runner.journal.base import Commit, NewRun, PruneReport, new_runs
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    utc_now,
)
from fsm_runner.run_ids import check_run_id, check_run_ids

__all__ = ["INSERT_RUN", "PRUNE_BATCH", "TRANSITION_COLUMNS", "PostgresWriter", "utc"]

# Every row written carries its digest (schema 9: see ._postgres_chain), its last value.
INSERT_RUN = (
    f"INSERT INTO runs ({', '.join(STORED_RUN_COLUMNS)})"
    f" VALUES ({', '.join(['%s'] * len(STORED_RUN_COLUMNS))})"
)
TRANSITION_COLUMNS = _rows.TRANSITION_COLUMNS
#: Where a run row's context and error are in its parameters (``_rows.RUN_COLUMNS``).
_CONTEXT, _ERROR = _rows.RUN_COLUMNS.index("context"), _rows.RUN_COLUMNS.index("error")
_INSERT_TRANSITION = (
    f"INSERT INTO transitions ({', '.join(STORED_TRANSITION_COLUMNS)})"
    f" VALUES ({', '.join(['%s'] * len(STORED_TRANSITION_COLUMNS))})"
)
#: How many runs' head digests a writer remembers (a miss costs one read before a commit).
_REMEMBERED_HEADS = 100_000
#: The hot path, one statement: move the run row from seq N-1 to N — only if it is at N-1 and
#: the writer holds its current lease token (fencing), and, when an abort was requested under
#: that token, only for the USER_ABORTED that carries it out — and insert transition N from it.
#: A transition that ends the run also ends its lease (owner and expiry; the token stays) and
#: clears its wake time (a plain step writes ``wake_at`` as it is: no index entry changes).
#: The run row's digest and the transition's (chained to the run's previous one) are computed
#: by the writer and bound here (schema 9); no index holds either.
_COMMIT_TEMPLATE = """
WITH moved AS (
    UPDATE runs SET state = %s, seq = %s, iteration = %s, updated_at = %s, status = %s,
                    attempt = %s, context = %s, error = %s, digest = %s, return_to = %s,
                    return_attempt = %s,
                    return_visit = %s, visit_seq = %s,
                    abort_reason = CASE WHEN %s THEN NULL ELSE abort_reason END,
                    abort_token = CASE WHEN %s THEN NULL ELSE abort_token END,
                    lease_owner = CASE WHEN %s THEN NULL ELSE lease_owner END,
                    lease_expires_at = CASE WHEN %s THEN NULL ELSE lease_expires_at END,
                    wake_at = CASE WHEN %s THEN NULL ELSE wake_at END{spec}
     WHERE run_id = %s AND seq = %s AND lease_token = %s
       AND (abort_token IS NULL OR abort_token < lease_token OR %s)
    RETURNING run_id
)
INSERT INTO transitions (run_id, seq, from_state, event, to_state, iteration, attempt, at,
                         duration_ms, result, lease_token, digest)
SELECT run_id, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s FROM moved
"""
_COMMIT = _COMMIT_TEMPLATE.format(spec="")
_COMMIT_WITH_SPEC = _COMMIT_TEMPLATE.format(spec=", spec_hash = %s")
#: Mark a pending signal of the run consumed by the transition at that seq and time.
_CONSUME_SIGNAL = (
    "UPDATE signals SET consumed_seq = %s, consumed_at = %s"
    " WHERE number = %s AND run_id = %s AND consumed_seq IS NULL"
)


def _upsert(table: str, columns: Sequence[str], *, also: str = "") -> str:
    """An INSERT of ``columns`` that updates the row keyed by the first two where there is one."""
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
        f" ON CONFLICT ({', '.join(columns[:2])}) DO UPDATE SET "
        + ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[2:])
        + also
    )


_UPSERT_ITERATION = _upsert("iterations", (*_rows.ITERATION_COLUMNS, "digest"))
# A replaced artifact takes a new id, so artifacts stay ordered as committed (SQLite's REPLACE).
_UPSERT_ARTIFACT = _upsert("artifacts", (*_rows.ARTIFACT_COLUMNS, "digest"), also=", id = DEFAULT")


def _with_own(params: tuple[Any, ...]) -> tuple[Any, ...]:
    """An iteration's or artifact's parameters with its digest."""
    return (*params, own_digest(params))


def _existing(exc: pg_errors.UniqueViolation, runs: Sequence[NewRun]) -> str:
    """The id of the run that already exists, from the server's detail, else the first one's."""
    detail = exc.diag.message_detail or ""
    for run, _, _ in runs:
        if f"=({run.run_id})" in detail or f"=({run.run_id}, 0)" in detail:
            return run.run_id
    return runs[0][0].run_id


class _RefusedError(Exception):
    """A commit inside a transaction was refused: leave the transaction, rolling it back."""


#: The tables a prune deletes from, children first (the foreign keys are enforced).
_TABLES = ("transitions", "iterations", "artifacts", "effects", "signals", "runs")
#: How many runs a prune deletes a transaction (each batch's row locks end with it).
PRUNE_BATCH = 1000
#: The next batch of prunable runs after a keyset ``(ended_at, rowid)``: ended before the
#: cutoff, with no active child, in the order of the ``runs_ended`` index (one range of it).
_PRUNABLE = (
    "SELECT run_id, ended_at, rowid, spec_hash FROM runs AS r WHERE ended_at < %s"
    " AND (ended_at, rowid) > (%s, %s) AND NOT EXISTS (SELECT 1 FROM runs AS c"
    " WHERE c.parent_run_id = r.run_id AND c.status = 'active')"
    " ORDER BY ended_at, rowid LIMIT %s"
)
#: Before every run's ``ended_at``: where the first batch starts.
_BEFORE_ALL = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
_dumps = _rows.dumps
_UTC = dt.timezone.utc


def utc(value: dt.datetime | None) -> dt.datetime | None:
    """A datetime as PostgreSQL should store it: naive datetimes are taken as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=_UTC)


@attrs.frozen
class _CommitPlan:
    """One commit's statements: what :meth:`PostgresWriter.commit` runs, alone or in a group."""

    location: str
    transition: TransitionRecord
    #: The transition's digest (the run's head once it is stored).
    digest: str
    statement: str
    params: Sequence[Any]
    before: Sequence[tuple[str, Sequence[Any]]]
    after: Sequence[tuple[str, Sequence[Any]]]
    #: A step that leaves the row's digest as it was written here (``GROUP_NARROW`` may write it).
    narrow: bool = False

    @property
    def simple(self) -> bool:
        """Whether the commit is one statement (the hot path)."""
        return not self.before and not self.after

    def apply(self, conn: Connection) -> bool:
        """Run the statements; ``False`` when the commit was refused (the caller rolls back)."""
        for text, values in self.before:
            conn.execute(text, values)
        try:
            moved = reused_cursor(conn).execute(self.statement, self.params).rowcount
        except pg_errors.UniqueViolation as exc:
            if exc.diag.constraint_name != "transitions_pkey":
                raise
            return False  # a transition at that seq exists: another writer was first
        if moved != 1:
            return False
        for text, values in self.after:
            conn.execute(text, values)
        return True

    def apply_or_raise(self, conn: Connection) -> None:
        """Run the statements; raise :class:`_RefusedError` when the commit was refused."""
        if not self.apply(conn):
            raise _RefusedError

    def refusal(self, conn: Connection) -> Exception:
        """Why the commit was refused (asked once its statements are rolled back)."""
        transition = self.transition
        found = conn.execute(
            "SELECT seq, lease_token, abort_reason, abort_token FROM runs WHERE run_id = %s",
            (transition.run_id,),
        ).fetchone()
        return _lease.commit_refusal(
            found, transition.run_id, transition.seq - 1, transition.lease_token, path=self.location
        )

    def resolve(self, conn: Connection) -> Unresolved | None:
        """``None`` when this very transition is stored (a cut-off try did commit it)."""
        transition = self.transition
        row = conn.execute(
            "SELECT lease_token, at, event, to_state FROM transitions"
            " WHERE run_id = %s AND seq = %s",
            (transition.run_id, transition.seq),
        ).fetchone()
        expected = (
            transition.lease_token,
            utc(transition.at),
            transition.event,
            transition.to_state,
        )
        return None if row is not None and tuple(row) == expected else UNRESOLVED


def _pipelined(conn: Connection, plans: Sequence[tuple[int, _CommitPlan]]) -> bool:
    """Store a group of one-statement commits in two round trips, if none is refused.

    psycopg's pipeline sends BEGIN and every commit at once (commits of different runs as one
    statement, ``GROUP_COMMIT`` or ``GROUP_NARROW``), and reads their answers at one sync; then
    COMMIT. A refused commit (its fence moved no row, or another writer stored its seq first)
    rolls the group back here, and ``False`` sends it the careful way, a savepoint a commit, so
    that a refusal refuses its commit alone (as any failure of the group: a lost connection
    surfaces as before).
    """
    try:
        with conn.pipeline() as pipeline, conn.transaction():
            if _one_statement(plans):  # the group's work in one statement (_postgres_groups)
                narrow = all(plan.narrow for _, plan in plans)
                statement, params = group_statement([p.params for _, p in plans], narrow=narrow)
                cursor = conn.execute(statement, params)
                pipeline.sync()
                _moved(cursor, len(plans))
            else:
                cursors = [conn.execute(plan.statement, plan.params) for _, plan in plans]
                pipeline.sync()
                _each_moved_one(cursors)
    except (_RefusedError, pg_errors.UniqueViolation):
        return False
    return True


def _one_statement(plans: Sequence[tuple[int, _CommitPlan]]) -> bool:
    """Whether a group of one-statement commits can be one statement: each of another run.

    (Two commits of one run need two statements: one ``UPDATE ... FROM`` moves a row once.)
    """
    if len(plans) < 2 or any(
        plan.statement is not _COMMIT or len(plan.params) != COMMIT_PARAMS for _, plan in plans
    ):
        return False
    return len({plan.transition.run_id for _, plan in plans}) == len(plans)


def _moved(cursor: Any, runs: int) -> None:
    """Raise :class:`_RefusedError` unless the group's statement moved each of its ``runs``."""
    if cursor.rowcount != runs:
        raise _RefusedError


def _each_moved_one(cursors: Sequence[Any]) -> None:
    """Raise :class:`_RefusedError` unless every commit moved its run (one row each)."""
    if any(cursor.rowcount != 1 for cursor in cursors):
        raise _RefusedError


class PostgresWriter:
    """The fenced writes of one PostgreSQL journal.

    Args:
        connection: the journal's connection manager, which runs each write.
        core: the journal's shared SQL (row parameters, refusals).
    """

    def __init__(self, connection: PostgresConnection, core: SqlCore) -> None:
        self._connection = connection
        self._core = core
        #: Run id -> (seq, digest) of the run's last transition written or read here (its head
        #: when the next commit is at seq + 1): a step reads no digest to chain its own to.
        self._heads: dict[str, tuple[int, str]] = {}
        #: Run id -> (the run, the hash state of what its row's digest covers before its
        #: context, the last context and error text digested, their digest): a step hashes its
        #: context and error only (the input is not written again), and only when they changed.
        self._run_hashers: dict[str, tuple[RunRecord, Any, str | None, str | None, str]] = {}

    def create_runs(self, runs: Sequence[NewRun], *, spec_json: str) -> None:
        """Store new runs, each with its transition seq 0 and iterations, in ONE transaction.

        All or nothing: a run whose id exists refuses the whole batch (``RunExistsError``).
        """
        check_run_ids([run.run_id for run, _, _ in runs])
        if not new_runs(runs):
            return
        core = self._core
        digest = self._run_digest  # as a commit computes it: a first step may be narrow too
        rows = [(run, core.run_params(run)) for run, _, _ in runs]
        run_rows = [(*row, digest(run, row[_CONTEXT], row[_ERROR])) for run, row in rows]
        transition_rows = [core.transition_params(first) for _, first, _ in runs]
        transition_rows = [(*row, transition_chain_digest(None, row)) for row in transition_rows]
        iteration_rows = [
            _with_own(core.iteration_params(record))
            for _, _, iterations in runs
            for record in iterations
        ]
        last, last_first = runs[-1][0], runs[-1][1]
        spec_row = (last.spec_hash, last.machine, spec_json, utc_now())

        def work(conn: Connection) -> None:
            try:
                if not iteration_rows and len(runs) <= ONE_STATEMENT_STARTS:
                    # One statement, one round trip (a transaction of its own): the spec, the
                    # runs and their first transitions, the foreign keys checked at its end.
                    conn.execute(
                        start_statement(len(runs)),
                        [*spec_row, *chain(*run_rows), *chain(*transition_rows)],
                    )
                    return
                if not iteration_rows and len(runs) > BULK_STARTS:  # values as arrays
                    conn.execute(BULK_START, bulk_start_params(spec_row, run_rows, transition_rows))
                    return
                with conn.transaction(), conn.cursor() as cursor:
                    cursor.execute(INSERT_SPEC, spec_row)
                    cursor.executemany(INSERT_RUN, run_rows)
                    cursor.executemany(_INSERT_TRANSITION, transition_rows)
                    if iteration_rows:
                        cursor.executemany(_UPSERT_ITERATION, iteration_rows)
            except pg_errors.UniqueViolation as exc:
                # (in one statement, the existing run's transition seq 0 may be met first)
                if exc.diag.constraint_name in ("runs_pkey", "transitions_pkey"):
                    raise RunExistsError(_existing(exc, runs)) from None
                raise

        def resolve(conn: Connection) -> Unresolved | None:
            # One transaction: the batch is stored if its last run is, as written.
            row = conn.execute(
                "SELECT r.created_at, t.at, t.event FROM runs AS r JOIN transitions AS t"
                " ON t.run_id = r.run_id AND t.seq = 0 WHERE r.run_id = %s",
                (last.run_id,),
            ).fetchone()
            if row is not None and (row[0], row[1], row[2]) == (
                utc(last.created_at),
                utc(last_first.at),
                last_first.event,
            ):
                return None
            return UNRESOLVED

        self._connection.call(work, resolve=resolve)
        self._remember([(row[0], 0, row[-1]) for row in transition_rows])

    def _remember(self, heads: Sequence[tuple[str, int, str]]) -> None:
        """Remember runs' heads as stored: (run id, seq, digest)."""
        known = self._heads
        if len(known) + len(heads) > _REMEMBERED_HEADS:
            known.clear()
        for run_id, seq, digest in heads:
            known[run_id] = (seq, digest)

    def _run_digest(self, run: RunRecord, context: str | None, error: str | None) -> str:
        """The digest of ``run``'s row as a commit writes it, its context and error as JSON text.

        The values before its context (who the run is, its input) are hashed once a run and
        writer: a commit's run has them from the run started or read (``attrs.evolve`` keeps
        its input, the same object), so they are compared, the input by identity.
        """
        known = self._run_hashers.get(run.run_id)
        if known is not None:
            was, hasher = known[0], known[1]
            if (
                was.input is run.input
                and was.created_at == run.created_at
                and was.machine == run.machine
                and was.parent_run_id == run.parent_run_id
                and was.forked_from == run.forked_from
            ):
                if context == known[2] and error == known[3]:
                    return known[4]  # a plain step: the same context and error as the last
            else:
                hasher = run_hasher(run)
        else:
            if len(self._run_hashers) >= _REMEMBERED_HEADS:
                self._run_hashers.clear()
            hasher = run_hasher(run)
        digest = row_digest_from(hasher, (context, error))
        self._run_hashers[run.run_id] = (run, hasher, context, error, digest)
        return digest

    def remember_head(self, run_id: str, seq: int, digest: str) -> None:
        """Remember the run's head as read (a claim's): its next commit here chains to it."""
        self._remember([(run_id, seq, digest)])

    def forget(self, run_ids: Sequence[str]) -> None:
        """Forget the heads of these runs (pruned: their ids may come back)."""
        for run_id in run_ids:
            self._heads.pop(run_id, None)
            self._run_hashers.pop(run_id, None)

    def _previous(
        self, transition: TransitionRecord, planned: dict[str, tuple[int, str]] | None
    ) -> str | None:
        """The digest ``transition`` chains to: the run's head as written here, else as stored.

        ``planned``: the heads of a group's commits before it. A head this writer did not
        write (a run it has not stepped, or that was stepped elsewhere since) costs one read.
        """
        run_id, seq = transition.run_id, transition.seq
        head = (planned and planned.get(run_id)) or self._heads.get(run_id)
        if head is not None and head[0] == seq - 1:
            return head[1]
        row = self._connection.call(
            lambda conn: conn.execute(
                "SELECT digest FROM transitions WHERE run_id = %s AND seq = %s", (run_id, seq - 1)
            ).fetchone()
        )
        return None if row is None else row[0]

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

        def work(conn: Connection) -> None:
            if plan.simple:  # the hot path: one statement, one transaction
                if not plan.apply(conn):
                    raise plan.refusal(conn)
                return
            try:
                with conn.transaction():
                    plan.apply_or_raise(conn)
            except _RefusedError:  # and rolled back: nothing of it was written
                raise plan.refusal(conn) from None

        self._stored(plan, work)

    def _stored(self, plan: _CommitPlan, work: Callable[[Connection], None]) -> None:
        """Run a commit's ``work``; remember its head when it is stored, forget it if not."""
        run_id = plan.transition.run_id
        try:
            self._connection.call(work, resolve=plan.resolve)
        except BaseException:
            self._heads.pop(run_id, None)
            raise
        self._remember([(run_id, plan.transition.seq, plan.digest)])

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one transaction (see :meth:`Journal.commit_many`).

        Each commit runs in a savepoint of its own, rolled back when it is refused. After a
        lost connection the group is done again; a commit refused then because the cut-off try
        did store it (its transition is there, with its lease token, time and event) counts as
        stored.
        """
        results: list[Exception | None] = [None] * len(commits)
        plans: list[tuple[int, _CommitPlan]] = []
        planned: dict[str, tuple[int, str]] = {}  # the group's heads, for a run's next commit
        for index, item in enumerate(commits):
            try:
                plan = self._plan(
                    item.run,
                    item.transition,
                    item.iterations,
                    item.artifacts,
                    item.spec_json,
                    planned=planned,
                )
            except Exception as exc:  # noqa: BLE001, PERF203 - a malformed commit is refused alone
                results[index] = exc
            else:
                plans.append((index, plan))
                planned[item.run.run_id] = (item.transition.seq, plan.digest)
        if not plans:
            return results
        tries = 0

        def work(conn: Connection) -> dict[int, Exception]:
            nonlocal tries
            tries += 1
            if tries == 1 and all(plan.simple for _, plan in plans) and _pipelined(conn, plans):
                return {}  # every commit stored, in two round trips
            refused: dict[int, Exception] = {}
            with conn.transaction():
                for index, plan in plans:
                    conn.execute("SAVEPOINT one_commit")
                    if plan.apply(conn):
                        conn.execute("RELEASE SAVEPOINT one_commit")
                        continue
                    conn.execute("ROLLBACK TO SAVEPOINT one_commit")
                    if tries > 1 and not isinstance(plan.resolve(conn), Unresolved):
                        continue  # stored by the try that was cut off
                    refused[index] = plan.refusal(conn)
            return refused

        try:
            refused = self._connection.call(work)
        except JournalError as failure:
            self.forget([commit.run.run_id for commit in commits])
            return [failure if result is None else result for result in results]
        for index, refusal in refused.items():
            results[index] = refusal
        self.forget([commits[index].run.run_id for index in refused])
        self._remember(
            [
                (plan.transition.run_id, plan.transition.seq, plan.digest)
                for index, plan in plans
                if index not in refused
            ]
        )
        return results

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """Commit ``transition`` and mark signal ``number`` consumed by it, in ONE transaction.

        The commit is the one :meth:`commit` makes (its UPDATE locks the run row: a second
        consumer of the signal waits, then finds the run moved on); then the signal is marked,
        only while it is a pending signal of the run. Either refusal rolls both back: nothing
        is written. (The run row is locked before the signal's, as a prune locks them.)

        Raises:
            RunConflictError: the signal is not a pending signal of the run, or as
                :meth:`commit` raises it.
        """
        plan = self._plan(run, transition, (), (), None)
        mark = (transition.seq, utc(transition.at), number, run.run_id)

        def work(conn: Connection) -> None:
            try:
                with conn.transaction():
                    plan.apply_or_raise(conn)
                    if not conn.execute(_CONSUME_SIGNAL, mark).rowcount:
                        raise RunConflictError(
                            run_id=run.run_id,
                            expected_seq=transition.seq - 1,
                            path=self._connection.location,
                        )
            except _RefusedError:  # and rolled back: the signal is pending still
                raise plan.refusal(conn) from None

        self._stored(plan, work)

    def _plan(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        iterations: Sequence[IterationRecord],
        artifacts: Sequence[ArtifactRecord],
        spec_json: str | None,
        *,
        planned: dict[str, tuple[int, str]] | None = None,
    ) -> _CommitPlan:
        """The statements of one commit (checked, and its payloads serialised, up front)."""
        seq = transition.seq
        if run.seq != seq or run.state != transition.to_state or seq < 1:
            self._core.refuse_malformed(run, transition)
        aborting = transition.event == USER_ABORTED
        context, error = _dumps(run.context), _dumps(run.error)
        known = self._run_hashers.get(run.run_id)
        digest = self._run_digest(run, context, error)
        params: list[Any] = [
            transition.to_state,
            seq,
            transition.iteration,
            utc(transition.at),
            run.status.value,
            run.attempt,
            context,
            error,
            digest,
            run.return_to,
            run.return_attempt,
            run.return_visit,
            run.visit_seq,
            aborting,  # the abort carried out clears the request ...
            aborting,
            run.ended,  # a run that ends lets go of its lease (its token stays) ...
            run.ended,
            run.ended,  # ... and is due no more
        ]
        before: list[tuple[str, Sequence[Any]]] = []
        if spec_json is not None:
            params.append(run.spec_hash)
            before.append((INSERT_SPEC, (run.spec_hash, run.machine, spec_json, utc_now())))
        # ... and is the one transition taken under the token its abort was requested under
        params += [run.run_id, seq - 1, transition.lease_token, aborting]
        core = self._core
        values = core.transition_params(transition)
        # the row's digest as this writer last wrote it (its memory kept: context and error
        # the same), nowhere to return to: GROUP_NARROW leaves the rest of the row as it is
        narrow = (
            known is not None
            and self._run_hashers.get(run.run_id) is known
            and not (aborting or before or iterations or artifacts)
            and run.return_to is None
            and not (run.return_attempt or run.return_visit)
        )
        digest = transition_chain_digest(self._previous(transition, planned), values)
        params += values[1:]
        params.append(digest)
        after = [(_UPSERT_ITERATION, _with_own(core.iteration_params(i))) for i in iterations]
        after += [(_UPSERT_ARTIFACT, _with_own(core.artifact_params(a))) for a in artifacts]
        return _CommitPlan(
            location=self._connection.location,
            transition=transition,
            digest=digest,
            statement=_COMMIT if spec_json is None else _COMMIT_WITH_SPEC,
            params=params,
            before=before,
            after=after,
            narrow=narrow,
        )

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        check_run_id(run.run_id)
        _rows.check_fork(run, at_seq)
        row = self._core.run_params(run)
        row = (*row, run_digest(row))
        rest = [column for column in TRANSITION_COLUMNS if column not in ("run_id", "lease_token")]
        copy_transitions = (
            f"INSERT INTO transitions (run_id, {', '.join(rest)}, lease_token)"
            f" SELECT %s, {', '.join(rest)}, 0 FROM transitions"  # under the fork's own leases
            " WHERE run_id = %s AND seq <= %s ORDER BY seq"
        )
        copies = (
            ("iterations", _rows.ITERATION_COLUMNS, "iteration <= %s", "iteration", run.iteration),
            ("artifacts", _rows.ARTIFACT_COLUMNS, "seq <= %s", "id", at_seq),
            ("effects", _rows.EFFECT_COLUMNS, "visit_seq < %s", "rowid", run.visit_seq),
        )

        def work(conn: Connection) -> None:
            with conn.transaction():
                found = conn.execute(
                    "SELECT seq FROM runs WHERE run_id = %s FOR SHARE", (source_run_id,)
                ).fetchone()
                if found is None:
                    raise RunNotFoundError(source_run_id)
                _rows.check_fork_source(source_run_id, found[0], at_seq)
                try:
                    with conn.transaction():
                        conn.execute(INSERT_RUN, row)
                except pg_errors.UniqueViolation as exc:
                    if exc.diag.constraint_name == "runs_pkey":
                        raise RunExistsError(run.run_id) from None
                    raise
                conn.execute(copy_transitions, (run.run_id, source_run_id, at_seq))
                for table, columns, condition, order, bound in copies:
                    names = [column for column in columns if column != "run_id"]
                    conn.execute(
                        f"INSERT INTO {table} (run_id, {', '.join(names)})"
                        f" SELECT %s, {', '.join(names)} FROM {table}"
                        f" WHERE run_id = %s AND {condition} ORDER BY {order}",
                        (run.run_id, source_run_id, bound),
                    )
                # The copies belong to another run (and hold no lease token): their digests
                # are the fork's own, chained from its seq 0.
                fill_digests(conn, run_id=run.run_id)

        def resolve(conn: Connection) -> Unresolved | None:
            found = conn.execute(
                "SELECT forked_from, created_at FROM runs WHERE run_id = %s", (run.run_id,)
            ).fetchone()
            if found is not None and tuple(found) == (run.forked_from, utc(run.created_at)):
                return None
            return UNRESOLVED

        self._connection.call(work, resolve=resolve)
        self._heads.pop(run.run_id, None)

    def prune(
        self, *, ended_before: dt.datetime, dry_run: bool = False, batch_size: int = PRUNE_BATCH
    ) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, then ``VACUUM`` the tables.

        The runs are found on the ``runs_ended`` index, oldest first, and deleted
        ``batch_size`` runs a transaction, each batch committed before the next is read: a
        writer never waits for a prune longer than one batch, and the work (dry run too) grows
        with the runs pruned, not with the journal. The space is made reusable by the journal
        (PostgreSQL's plain ``VACUUM``, which does not block writers), not given back to the
        operating system, so the report carries no sizes.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
        cutoff = utc(ended_before)
        run_ids: list[str] = []
        transitions = 0
        after: tuple[Any, ...] = (_BEFORE_ALL, 0)  # the keyset: the last run read
        while True:
            rows, count = self._prune_batch(cutoff, after, batch_size, dry_run=dry_run)
            run_ids += (str(row[0]) for row in rows)
            transitions += count
            if len(rows) < batch_size:
                break
            after = (rows[-1][1], rows[-1][2])
        if not dry_run:
            self.forget(run_ids)
        if run_ids and not dry_run:
            self._connection.call(
                lambda conn: conn.execute("VACUUM " + ", ".join((*_TABLES, "specs")))
            )
        return PruneReport(tuple(run_ids), transitions, dry_run=dry_run)

    def _prune_batch(
        self, cutoff: dt.datetime | None, after: tuple[Any, ...], limit: int, *, dry_run: bool
    ) -> tuple[list[tuple[Any, ...]], int]:
        """One batch of a prune, in its own transaction: its rows and transition count."""
        query = _PRUNABLE + ("" if dry_run else " FOR UPDATE OF r")
        written: list[tuple[list[tuple[Any, ...]], int]] = []  # the try that reached COMMIT

        def work(conn: Connection) -> tuple[list[tuple[Any, ...]], int]:
            with conn.transaction():
                rows = [tuple(row) for row in conn.execute(query, (cutoff, *after, limit))]
                ids = [row[0] for row in rows]
                if dry_run or not ids:
                    found = conn.execute(
                        "SELECT count(*) FROM transitions WHERE run_id = ANY(%s)", (ids,)
                    ).fetchone()
                    return rows, int(found[0] if found else 0)
                count = 0
                for table in _TABLES:
                    deleted = conn.execute(
                        f"DELETE FROM {table} WHERE run_id = ANY(%s)", (ids,)
                    ).rowcount
                    if table == "transitions":
                        count = deleted
                _drop_unused_specs(conn, sorted({row[3] for row in rows}))
                written[:] = [(rows, count)]
            return rows, count

        def resolve(conn: Connection) -> tuple[list[tuple[Any, ...]], int] | Unresolved:
            if not written:
                return UNRESOLVED
            rows, count = written[0]
            left = conn.execute(
                "SELECT 1 FROM runs WHERE run_id = ANY(%s) LIMIT 1", ([row[0] for row in rows],)
            ).fetchone()
            return (rows, count) if left is None else UNRESOLVED  # gone: that batch committed

        return self._connection.call(work, resolve=resolve)


def _drop_unused_specs(conn: Connection, spec_hashes: list[str]) -> None:
    """Delete those of the pruned runs' specs that no run uses any more (``runs_spec_hash``).

    A run started meanwhile under one of them keeps it: the foreign key refuses the delete,
    and the savepoint lets the prune go on without it.
    """
    try:
        with conn.transaction():
            conn.execute(
                "DELETE FROM specs WHERE spec_hash = ANY(%s) AND NOT EXISTS"
                " (SELECT 1 FROM runs WHERE runs.spec_hash = specs.spec_hash)",
                (spec_hashes,),
            )
    except pg_errors.ForeignKeyViolation:
        pass
