"""The PostgreSQL journal: one database shared by many workers on many hosts.

The same contract as :class:`~fsm_runner.journal.sqlite.SqliteJournal`, on PostgreSQL through
psycopg 3 (``pip install 'fsm-runner[postgres]'``). The tables, columns and schema versions are the
SQLite journal's (see :mod:`fsm_runner.journal._postgres_schema`), in a PostgreSQL schema of
their own (``?schema=NAME``; ``public`` by default), so several journals share one database.

How it keeps the contract:

* **One transaction per commit.** The hot-path commit is a single statement, run in autocommit
  mode: an ``UPDATE`` of the run row, fenced by its seq and lease token, and the ``INSERT`` of the
  transition that follows from it (a data-modifying ``WITH``). Either both happen or neither.
  Iterations, artifacts and a spec change share one short explicit transaction with it.
* **Leases** are set and judged by the server's clock (``clock_timestamp()``), not the
  workers': hosts whose clocks disagree still agree on when a lease expires.
* **Fencing** is explicit SQL in every write that a lease holder makes: the transition commit
  (``seq = N - 1 AND lease_token = T``), ``put_effect`` (which share-locks the run row it checks,
  so the run cannot move on before the effect is written), ``renew`` and ``release``.
* **Claims** lock the run row (``FOR UPDATE``); ``claim_next`` picks the longest-waiting runnable
  run with ``FOR UPDATE SKIP LOCKED``, so workers on many hosts never claim one run twice and never
  queue behind each other.
* **Lost connections** (the server restarted, the backend was terminated, the network dropped)
  are reconnected with backoff for up to ``retry_for`` seconds, then the operation is retried.
  When a write's outcome is unknown — the connection died while its COMMIT was on the wire — the
  journal first looks for what that write would have left (the transition at ``(run_id, seq)``
  with the same lease token, time and event; the lease with the exact expiry it set; ...) and
  takes it as committed, else does it again; the fencing makes doing it again safe.

Opening the journal connects once, without retrying: a wrong URL or password, or a server that
is not there, is reported at once. Passwords never appear in messages or in :attr:`location`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import urllib.parse
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from fsm_runner import _fork
from fsm_runner.exceptions import (
    JournalError,
    RunExistsError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._postgres_schema import SCHEMA_VERSION, PostgresOpening
from fsm_runner.journal._postgres_url import is_postgres_url, passwords, redact, split_schema
from fsm_runner.journal._postgres_writes import (
    _INSERT_RUN,
    _TRANSITION_COLUMNS,
    _UNRESOLVED,
    DEFAULT_RETRY_FOR,
    _Connection,
    _Unresolved,
    _utc,
)
from fsm_runner.journal.base import Durability, PruneReport, Renewal, claim_each, renewals
from fsm_runner.records import (
    RunRecord,
    TransitionRecord,
)

__all__ = [
    "DEFAULT_RETRY_FOR",
    "DEFAULT_SCHEMA",
    "SCHEMA_VERSION",
    "PostgresJournal",
    "is_postgres_url",
    "redact",
]

T = TypeVar("T")

#: The PostgreSQL schema (namespace) a journal lives in when the URL names none.
DEFAULT_SCHEMA = "public"

_RUN_SELECT = ", ".join(_rows.RUN_COLUMNS)
# FOR SHARE: the run row cannot move on (a commit updates it) until the effect is written.
_PUT_EFFECT = (
    f"INSERT INTO effects ({', '.join(_rows.EFFECT_COLUMNS)})"
    f" SELECT {', '.join(['%s'] * len(_rows.EFFECT_COLUMNS))}"
    " WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = %s AND seq = %s"
    " AND (%s::bigint IS NULL OR lease_token = %s) FOR SHARE)"
    " ON CONFLICT (run_id, visit_seq, name) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in _rows.EFFECT_COLUMNS[3:])
    + ", rowid = DEFAULT"
)
_TABLES = ("transitions", "iterations", "artifacts", "effects", "runs")


def _server_now(conn: _Connection) -> dt.datetime:
    """The database server's time: leases are set and judged by one clock, whatever the hosts'.

    Workers on several hosts each see a lease expire when the *server's* clock passes it, so a
    host whose own clock runs ahead cannot take over runs that are still held.
    """
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now: dt.datetime = row[0]
    return now


class PostgresJournal(PostgresOpening):
    """A journal in a PostgreSQL database, shared by every worker that connects to it.

    Args:
        url: ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME[?schema=NAME&...]`` (also
            ``postgres://``, or a libpq ``key=value`` string); other query parameters go to
            libpq (``sslmode``, ``connect_timeout``, ...).
        schema: the PostgreSQL schema the journal's tables live in (overrides ``?schema=``);
            created when missing. ``public`` when neither names one.
        durability: ``process`` or ``power``: both keep ``synchronous_commit = on`` (a commit
            is in the server's WAL on disk when it returns). With a shared server, the process
            that may be killed is the server's too, and a run's next phase must never start on
            a transition a server crash could take back; ``off`` would allow exactly that.
        create: create the schema and tables when they do not exist; when ``False`` a
            missing journal raises :class:`JournalError`.
        retry_for: seconds an operation keeps trying to get a lost connection back before it
            raises :class:`JournalError`.

    Raises:
        JournalError: the URL is malformed, the server cannot be reached or refuses the login,
            the schema holds tables that are not an fsm_runner journal, or (``create=False``)
            there is no journal.
        SchemaVersionError: the journal was written by a newer fsm_runner.
    """

    _MARK = "%s"
    _RUN_TABLE = "runs"
    _RUN_SELECT = _RUN_SELECT
    _ROW_ORDER = "rowid"
    _RUN_TRANSITIONS = "run_id = %s"
    _PUT_EFFECT = _PUT_EFFECT
    _stamp = staticmethod(_utc)

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        durability: Durability = "process",
        create: bool = True,
        retry_for: float = DEFAULT_RETRY_FOR,
    ) -> None:
        if durability not in ("process", "power"):
            raise ValueError(f"durability must be 'process' or 'power', not {durability!r}")
        self._secrets = passwords(url)  # kept out of every message
        conninfo, url_schema = split_schema(url)
        if schema is not None and url_schema is not None and schema != url_schema:
            raise ValueError(f"schema {schema!r} contradicts the URL's ?schema={url_schema}")
        self.schema: str = schema or url_schema or DEFAULT_SCHEMA
        self.durability: Durability = durability
        self.retry_for = retry_for
        shown = redact(conninfo)
        if is_postgres_url(conninfo):
            joiner = "&" if "?" in shown else "?"
            self._location = f"{shown}{joiner}schema={urllib.parse.quote(self.schema)}"
        else:
            self._location = f"{shown} schema={self.schema}"
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise JournalError(
                f"is not a valid PostgreSQL URL ({self._describe(exc)})",
                path=self._location,
            ) from None
        self._conninfo = conninfo
        self._connect_options: dict[str, Any] = {}
        if "application_name" not in params:
            self._connect_options["application_name"] = "fsm_runner"
        if "connect_timeout" not in params:
            self._connect_options["connect_timeout"] = 10
        self._lock, self._closed = threading.RLock(), False
        self._conn: _Connection | None = None
        try:
            conn = self._connect()
        except psycopg.Error as exc:
            raise JournalError(
                f"cannot connect to PostgreSQL ({self._describe(exc)})", path=self._location
            ) from None
        try:
            self._open_schema(conn, create=create)
        except psycopg.Error as exc:
            conn.close()
            raise JournalError(self._describe(exc), path=self._location) from None
        except BaseException:
            conn.close()
            raise
        _fork.register(self)  # a forked child gets a connection of its own

    @property
    def location(self) -> str:
        """The journal's URL with its schema, without the password."""
        return self._location

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    @property
    def backend_pid(self) -> int | None:
        """The process id of this journal's server backend (``None`` while disconnected)."""
        conn = self._conn
        if conn is None or conn.closed:
            return None
        return int(conn.info.backend_pid)

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""

        def work(conn: _Connection) -> RunRecord:
            with conn.transaction():
                run = self._load(conn, run_id, lock=True)
                if run.ended:
                    raise RunTerminalError(run_id=run_id, state=run.state, status=run.status.value)
                cursor = conn.execute(
                    "UPDATE runs SET abort_reason = %s, abort_token = lease_token"
                    f" WHERE run_id = %s RETURNING {_RUN_SELECT}",
                    (reason, run_id),
                )
                return self._run_from_row(cursor.fetchone())

        return self._call(work)

    # -- leases --------------------------------------------------------------------------------

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds; its token increases by one.

        Granted when nobody holds the lease, when it has expired (a takeover: the run's
        ``recoveries`` count increases), or when ``owner`` holds it already.
        """
        tried: list[dt.datetime] = []  # the expiry each try set: the resolver looks for them

        def work(conn: _Connection) -> RunRecord:
            with conn.transaction():
                run = self._load(conn, run_id, lock=True)
                now = _server_now(conn)
                expires = now + dt.timedelta(seconds=ttl)
                tried.append(expires)
                takeover = _lease.grant(run, owner, now, take_over=take_over)
                cursor = conn.execute(
                    "UPDATE runs SET lease_owner = %s, lease_expires_at = %s,"
                    " lease_token = lease_token + 1, recoveries = recoveries + %s"
                    f" WHERE run_id = %s RETURNING {_RUN_SELECT}",
                    (owner, expires, int(takeover), run_id),
                )
                return self._run_from_row(cursor.fetchone())

        def resolve(conn: _Connection) -> RunRecord | _Unresolved:
            run = self._load(conn, run_id)
            if run.lease_owner == owner and run.lease_expires_at in tried:
                return run  # the lease this very claim set
            return _UNRESOLVED

        return self._call(work, resolve=resolve)

    def claim_unchanged(self, run: RunRecord, owner: str, *, ttl: float) -> RunRecord | None:
        """Claim ``run``'s lease if the stored run is still as ``run`` shows it; else ``None``.

        One UPDATE (its expiry by the server's clock), no read beyond its ``RETURNING``:
        granted only while the run is active at ``run.seq`` with ``run``'s lease token, no
        lease held and no abort requested. ``None``: nothing was written.
        """

        def work(conn: _Connection) -> RunRecord | None:
            cursor = conn.execute(
                "UPDATE runs SET lease_owner = %s,"
                " lease_expires_at = clock_timestamp() + %s * interval '1 second',"
                " lease_token = lease_token + 1 WHERE run_id = %s AND seq = %s"
                " AND lease_token = %s AND lease_owner IS NULL AND abort_reason IS NULL"
                f" AND status = 'active' RETURNING {_RUN_SELECT}",
                (owner, ttl, run.run_id, run.seq, run.lease_token),
            )
            row = cursor.fetchone()
            return None if row is None else self._run_from_row(row)

        def resolve(conn: _Connection) -> RunRecord | _Unresolved | None:
            stored = self._load(conn, run.run_id)
            if stored.lease_owner == owner and stored.lease_token == run.lease_token + 1:
                return stored  # the lease this very claim set
            if stored.lease_token == run.lease_token and stored.lease_owner is None:
                return _UNRESOLVED  # not written: try again
            return None

        return self._call(work, resolve=resolve)

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases, each in its own transaction and refused on its own."""
        return claim_each(self, run_ids, owner, ttl=ttl, check=check)

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        machine: str,
        states: Collection[str],
        spec_hash: str | None = None,
    ) -> RunRecord | None:
        """Claim the oldest runnable run, or ``None``.

        One statement: the oldest runnable run not locked by another worker's claim is chosen
        with ``FOR UPDATE SKIP LOCKED`` and its lease taken, so concurrent workers each get a
        different run and never wait for each other.
        """
        if not states:
            return None
        spec_filter = " AND spec_hash = %s" if spec_hash is not None else ""
        statement = (
            "WITH chosen AS (SELECT run_id, lease_owner FROM runs WHERE status = 'active'"
            " AND machine = %s AND state = ANY(%s)"
            " AND (lease_owner IS NULL OR lease_expires_at < %s)"
            f"{spec_filter} ORDER BY created_at, rowid LIMIT 1 FOR UPDATE SKIP LOCKED)"
            " UPDATE runs SET lease_owner = %s, lease_expires_at = %s,"
            " lease_token = runs.lease_token + 1,"
            " recoveries = runs.recoveries + (chosen.lease_owner IS NOT NULL)::int"
            " FROM chosen WHERE runs.run_id = chosen.run_id RETURNING "
            + ", ".join(f"runs.{column}" for column in _rows.RUN_COLUMNS)
        )
        tried: list[dt.datetime] = []

        def work(conn: _Connection) -> RunRecord | None:
            now = _server_now(conn)
            expires = now + dt.timedelta(seconds=ttl)
            tried.append(expires)
            params: list[Any] = [machine, list(states), now]
            if spec_hash is not None:
                params.append(spec_hash)
            params += [owner, expires]
            row = conn.execute(statement, params).fetchone()
            return None if row is None else self._run_from_row(row)

        def resolve(conn: _Connection) -> RunRecord | _Unresolved | None:
            row = conn.execute(
                f"SELECT {_RUN_SELECT} FROM runs WHERE lease_owner = %s"
                " AND lease_expires_at = ANY(%s) AND machine = %s",
                (owner, tried, machine),
            ).fetchone()
            return _UNRESOLVED if row is None else self._run_from_row(row)

        return self._call(work, resolve=resolve)

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""

        def work(conn: _Connection) -> dt.datetime:
            expires = _server_now(conn) + dt.timedelta(seconds=ttl)
            changed = conn.execute(
                "UPDATE runs SET lease_expires_at = %s WHERE run_id = %s AND lease_owner = %s"
                " AND lease_token = %s",
                (expires, run_id, owner, token),
            ).rowcount
            if not changed:
                raise self._lease_lost(conn, run_id, token)
            return expires

        return self._call(work)  # setting an expiry again is harmless

    def renew_many(
        self, leases: Sequence[tuple[str, int]], owner: str, *, ttl: float
    ) -> dict[str, Renewal]:
        """Renew the ``(run_id, token)`` leases of ``owner`` in ONE transaction (``Journal``)."""
        run_ids, tokens = [run_id for run_id, _ in leases], [token for _, token in leases]

        def work(conn: _Connection) -> dict[str, Renewal]:
            with conn.transaction():
                conn.execute(
                    "UPDATE runs SET lease_expires_at = %s FROM unnest(%s::text[], %s::bigint[])"
                    " AS held(run_id, token) WHERE runs.run_id = held.run_id"
                    " AND runs.lease_token = held.token AND runs.lease_owner = %s",
                    (_server_now(conn) + dt.timedelta(seconds=ttl), run_ids, tokens, owner),
                )
                rows = conn.execute(
                    "SELECT run_id, lease_owner, lease_token, abort_reason, status FROM runs"
                    " WHERE run_id = ANY(%s)",
                    (run_ids,),
                ).fetchall()
            return renewals(leases, owner, {row[0]: row[1:] for row in rows})

        return self._call(work)  # setting expiries again is harmless

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it."""

        def work(conn: _Connection) -> bool:
            return bool(
                conn.execute(
                    "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL"
                    " WHERE run_id = %s AND lease_owner = %s AND lease_token = %s",
                    (run_id, owner, token),
                ).rowcount
            )

        def resolve(conn: _Connection) -> bool | _Unresolved:
            row = conn.execute(
                "SELECT lease_owner, lease_token FROM runs WHERE run_id = %s", (run_id,)
            ).fetchone()
            if row is not None and row[0] is None and row[1] == token:
                return True  # released by the try that was cut off, and nobody claimed since
            return _UNRESOLVED

        return self._call(work, resolve=resolve)

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        _rows.check_fork(run, at_seq)
        row = self._run_params(run)
        rest = [column for column in _TRANSITION_COLUMNS if column not in ("run_id", "lease_token")]
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

        def work(conn: _Connection) -> None:
            with conn.transaction():
                found = conn.execute(
                    "SELECT seq FROM runs WHERE run_id = %s FOR SHARE", (source_run_id,)
                ).fetchone()
                if found is None:
                    raise RunNotFoundError(source_run_id)
                _rows.check_fork_source(source_run_id, found[0], at_seq)
                try:
                    with conn.transaction():
                        conn.execute(_INSERT_RUN, row)
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

        def resolve(conn: _Connection) -> _Unresolved | None:
            found = conn.execute(
                "SELECT forked_from, created_at FROM runs WHERE run_id = %s", (run.run_id,)
            ).fetchone()
            if found is not None and tuple(found) == (run.forked_from, _utc(run.created_at)):
                return None
            return _UNRESOLVED

        self._call(work, resolve=resolve)

    def prune(self, *, ended_before: dt.datetime, dry_run: bool = False) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, then ``VACUUM`` the tables.

        The space is made reusable by the journal (PostgreSQL's plain ``VACUUM``), not given
        back to the operating system, so the report carries no sizes.
        """
        select = (
            "SELECT run_id FROM runs AS r WHERE status != 'active' AND updated_at < %s"
            " AND NOT EXISTS (SELECT 1 FROM runs AS c WHERE c.parent_run_id = r.run_id"
            " AND c.status = 'active')"
        )
        cutoff = (_utc(ended_before),)

        def work(conn: _Connection) -> PruneReport:
            with conn.transaction():
                ids = tuple(
                    str(row[0])
                    for row in conn.execute(
                        f"{select} ORDER BY updated_at NULLS FIRST, rowid"
                        + ("" if dry_run else " FOR UPDATE"),
                        cutoff,
                    )
                )
                if dry_run or not ids:
                    found = conn.execute(
                        "SELECT count(*) FROM transitions WHERE run_id = ANY(%s)", (list(ids),)
                    ).fetchone()
                    return PruneReport(ids, int(found[0] if found else 0), dry_run=dry_run)
                count = 0
                for table in _TABLES:
                    deleted = conn.execute(
                        f"DELETE FROM {table} WHERE run_id = ANY(%s)", (list(ids),)
                    ).rowcount
                    if table == "transitions":
                        count = deleted
                conn.execute(
                    "DELETE FROM specs WHERE NOT EXISTS"
                    " (SELECT 1 FROM runs WHERE runs.spec_hash = specs.spec_hash)"
                )
                return PruneReport(ids, count, dry_run=False)

        report = self._call(work)
        if report.run_ids and not dry_run:
            self._call(lambda conn: conn.execute("VACUUM " + ", ".join((*_TABLES, "specs"))))
        return report

    def integrity_problems(self) -> list[str]:
        """Runs whose row is not their last transition's, and runs with gaps in their seqs.

        PostgreSQL checks its own pages and the foreign keys (which it enforces); what is left
        to check is the journal's invariants 1 and 2, over every run.
        """
        checks = (
            (
                "SELECT r.run_id FROM runs AS r LEFT JOIN LATERAL (SELECT seq, to_state"
                " FROM transitions AS t WHERE t.run_id = r.run_id ORDER BY seq DESC LIMIT 1)"
                " AS last ON true WHERE last.seq IS DISTINCT FROM r.seq"
                " OR last.to_state IS DISTINCT FROM r.state ORDER BY r.run_id",
                "run(s) whose row is not at their last transition",
            ),
            (
                "SELECT run_id FROM transitions GROUP BY run_id"
                " HAVING min(seq) <> 0 OR count(*) <> max(seq) + 1 ORDER BY run_id",
                "run(s) with gaps in their seqs",
            ),
        )

        def work(conn: _Connection) -> list[str]:
            problems = []
            for query, what in checks:
                ids = [str(row[0]) for row in conn.execute(query)]
                if ids:
                    problems.append(f"{len(ids)} {what} (first {ids[0]})")
            return problems

        return self._call(work)

    def meta(self) -> Mapping[str, str]:
        """The journal's ``meta`` table (schema version, format)."""
        return self._call(
            lambda conn: {
                str(key): str(value)
                for key, value in conn.execute("SELECT key, value FROM meta").fetchall()
            }
        )

    # -- reads ---------------------------------------------------------------------------------

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row (one primary-key lookup; history is not read)."""
        return self._call(lambda conn: self._load(conn, run_id))

    def _load(self, conn: _Connection, run_id: str, *, lock: bool = False) -> RunRecord:
        row = conn.execute(
            f"SELECT {_RUN_SELECT} FROM runs WHERE run_id = %s" + (" FOR UPDATE" if lock else ""),
            (run_id,),
        ).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        return self._run_from_row(row)

    def _run_from_row(self, row: Sequence[Any] | None) -> RunRecord:
        assert row is not None
        return self._decode_run(dict(zip(_rows.RUN_COLUMNS, row, strict=True)))

    def _select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        def work(conn: _Connection) -> tuple[list[str], list[tuple[Any, ...]]]:
            cursor = conn.execute(query, params)
            return [column.name for column in cursor.description or ()], cursor.fetchall()

        return self._call(work)

    def _writing(self, work: Callable[[_Connection], T]) -> T:
        return self._call(work)

    def _stale_bound(self) -> tuple[str, list[Any]]:
        return "clock_timestamp()", []

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""

        def work(conn: _Connection) -> list[tuple[Any, ...]]:
            self._require_run(conn, run_id)
            return conn.execute(
                f"SELECT {', '.join(_TRANSITION_COLUMNS)} FROM transitions"
                " WHERE run_id = %s AND seq >= %s AND seq <= %s ORDER BY seq",
                (run_id, from_seq, to_seq if to_seq is not None else 2**62),
            ).fetchall()

        return self._transition_records(_TRANSITION_COLUMNS, self._call(work))
