"""The SQLite journal: the embedded default, one file that sqlite-utils and Datasette can browse.

Schema and migrations go through ``sqlite-utils``; the hot path (one commit per transition) uses
prepared SQL on the raw connection, in WAL mode, inside ``BEGIN IMMEDIATE`` with a busy timeout
so concurrent writers queue instead of failing with "database is locked".

This module opens the file and holds the reads, claims and operations that are SQLite's own;
the writes (the connection guard, error mapping and the fenced commit) are in
:mod:`~fsm_runner.journal._sqlite_writes`, the schema-object checks in
:mod:`~fsm_runner.journal._sqlite_check`, and what is the same on PostgreSQL in
:mod:`~fsm_runner.journal._sql`.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from fsm_runner import _fork
from fsm_runner.exceptions import (
    JournalError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._checkpoint import Checkpointer
from fsm_runner.journal._sql import _IDS_A_STATEMENT
from fsm_runner.journal._sqlite_check import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    SqliteChecks,
)
from fsm_runner.journal._sqlite_writes import (
    _BULK_ROWS,
    _INSERT_RUN,
    _TRANSITION_PARAMS,
    _inserted_key,
    refused_if_exists,
)
from fsm_runner.journal.base import Durability, PruneReport, Renewal, renewals
from fsm_runner.records import (
    RunRecord,
    TransitionRecord,
    format_utc,
    utc_now,
)

__all__ = ["APPLICATION_ID", "DEFAULT_PATH", "SCHEMA_VERSION", "TUNING", "SqliteJournal"]

#: Where the CLI looks when neither ``--journal`` nor ``FSM_RUNNER_JOURNAL`` is given.
DEFAULT_PATH = "fsm-runner.db"

_LIMIT_VARIABLE_NUMBER = 9  # sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER (Python 3.11+)
#: Pragmas of every connection beyond WAL, synchronous and the page cache (benchmarks give their
#: raw baselines the same). A checkpoint (with its fsyncs) once the WAL holds 10,000 pages
#: (~40 MB) instead of SQLite's 1,000: a group commit of a thousand runs writes ~1,000 pages, and
#: a checkpoint after every one cost ~15 % of its time (bench_concurrent). The WAL file is cut
#: back to 64 MiB after a checkpoint; a crashed process's WAL is replayed on the next open
#: (tens of milliseconds at that size).
TUNING = {"wal_autocheckpoint": 10_000, "journal_size_limit": 64 * 1024 * 1024}

T = TypeVar("T")


class SqliteJournal(SqliteChecks):
    """A journal in one SQLite file (WAL mode).

    Args:
        path: the database file; created with the schema if it does not exist.
        create: make a journal of a missing file, or of an empty one (0 bytes, or a SQLite
            database without tables); when ``False`` such a file is refused, left as it was.
            Commands that only read a journal open it so.
        durability: ``process`` (default, synchronous=NORMAL: survives a killed process) or
            ``power`` (synchronous=FULL: survives power loss).
        busy_timeout: seconds a writer waits for another one before giving up.
        checkpoint_thread: copy the WAL back into the file on a thread of the journal's own,
            started by its first write (see :mod:`fsm_runner.journal._checkpoint`); ``False``
            leaves it all to SQLite's checkpoint inside the commit that crosses 10,000 pages.

    Raises:
        JournalError: the file is not a SQLite database, not an fsm_runner journal, corrupt,
            read-only where a write is needed, or cannot be opened; or (``create=False``) it
            is missing or empty. A journal whose schema objects (the ``runs`` view, the
            triggers) differ from its schema version's opens, but refuses what they would
            make it misread or miswrite (see :meth:`schema_problems`).
        SchemaVersionError: the journal was written by a newer fsm_runner.
    """

    _MARK = "?"
    _RUN_TABLE = "run_rows"
    _RUN_SELECT = "*"  # the runs view, with run_key (remembered for commits)
    _ROW_ORDER = "run_key"
    _RUN_TRANSITIONS = "run_key = (SELECT run_key FROM run_rows WHERE run_id = ?)"
    _stamp = staticmethod(format_utc)
    _tuning = TUNING

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_PATH,
        *,
        durability: Durability = "process",
        busy_timeout: float = 30.0,
        create: bool = True,
        checkpoint_thread: bool = True,
    ) -> None:
        if durability not in ("process", "power"):
            raise ValueError(f"durability must be 'process' or 'power', not {durability!r}")
        self.path = str(Path(path).absolute()) if str(path) != ":memory:" else ":memory:"
        self.durability: Durability = durability
        self._lock = threading.RLock()
        self._closed = False
        self._written: dict[str, RunRecord] = {}  # run rows as last written or read here
        self._keys: dict[str, int] = {}  # run id -> run_rows.run_key, as read or written here
        self._update_sql: dict[tuple[str, ...], str] = {}
        self._create = create
        #: The thread that checkpoints the WAL (started by the first write transaction).
        self._checkpointer: Checkpointer | None = None
        self._checkpoint_thread = checkpoint_thread and self.path != ":memory:"
        #: Why reads, and why writes, are refused: a schema object they depend on is damaged.
        self._unreadable: str | None = None
        self._unwritable: str | None = None
        self._busy_timeout = busy_timeout
        self._shm_full = False
        self._check_header()
        if not create and self.path != ":memory:" and not os.path.exists(self.path):
            raise JournalError("does not exist; nothing was created", path=self.path)
        self._heal_side_files()
        with self._errors():
            self._conn = self._connect()
        try:
            with self._errors():
                # recursive_triggers stays off (SQLite's default; sqlite-utils would turn it on):
                # our one trigger never recurses, and on costs ~1 µs a step.
                self._cursor = self._conn.cursor()
                getlimit = getattr(self._conn, "getlimit", None)  # Python 3.11+
                variables = getlimit(_LIMIT_VARIABLE_NUMBER) if getlimit else 999
                self._bulk_rows = max(1, min(_BULK_ROWS, variables // _TRANSITION_PARAMS))
                self._open_file()
                # Foreign keys are declared (Datasette shows the links) but not enforced: the
                # journal's own transactions keep them, and enforcing costs every commit.
        except BaseException:
            self._conn.close()
            raise
        _fork.register(self)  # a forked child gets a connection of its own

    @property
    def location(self) -> str:
        """The journal file's absolute path."""
        return self.path

    def _disconnect(self) -> None:
        self._stop_checkpoints()
        self._conn.close()

    def _stop_checkpoints(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self._checkpointer = None

    def _start_checkpoints(self) -> None:
        """Checkpoint the WAL on a thread of its own from now on (see :mod:`._checkpoint`).

        Called by the first write transaction (of a journal with ``checkpoint_thread``; never
        ``:memory:``, which has no WAL), so that a journal opened only to be read starts none.
        """
        # By the file's real path: SQLite keeps the WAL beside a symlink's target.
        real = os.path.realpath(self.path)
        self._checkpointer = Checkpointer(self, real, size_limit=TUNING["journal_size_limit"])

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""
        with self._write() as conn:
            run = self._load(conn, run_id)
            if run.ended:
                raise RunTerminalError(run_id=run_id, state=run.state, status=run.status.value)
            conn.execute(
                "UPDATE run_rows SET abort_reason = ?, abort_token = lease_token WHERE run_id = ?",
                (reason, run_id),
            )
        return self.load(run_id)

    # -- reads ---------------------------------------------------------------------------------

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row (one primary-key lookup; history is not read)."""
        with self._read() as conn:
            return self._load(conn, run_id)

    def _load(self, conn: sqlite3.Connection, run_id: str) -> RunRecord:
        cursor = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        row = cursor.fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        run = self._run_from_row(cursor.description, row)
        self._remember(run)
        return run

    def _run_from_row(self, description: Any, row: Sequence[Any]) -> RunRecord:
        return self._decode_run(
            {column[0]: value for column, value in zip(description, row, strict=True)}
        )

    def _decode_run(self, data: dict[str, Any]) -> RunRecord:
        key = data.pop("run_key", None)  # the view's: remembered for this journal's commits
        if key is not None:
            self._remember_key(data["run_id"], key)
        return super()._decode_run(data)

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""
        with self._read() as conn:
            cursor = conn.execute(
                "SELECT * FROM transitions WHERE run_key = ? AND seq >= ? AND seq <= ?"
                " ORDER BY seq",
                (self._stored_key(conn, run_id), from_seq, 2**62 if to_seq is None else to_seq),
            )
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return self._transition_records(names, rows)

    def _select(
        self, query: str, params: Sequence[Any], *, damaged: bool = False
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        with self._read(damaged=damaged) as conn:
            cursor = conn.execute(query, params)
            return [column[0] for column in cursor.description], cursor.fetchall()

    def _writing(self, work: Callable[[sqlite3.Connection], T]) -> T:
        with self._write() as conn:
            return work(conn)

    def _stale_bound(self) -> tuple[str, list[Any]]:
        return "?", [format_utc(utc_now())]

    # -- leases --------------------------------------------------------------------------------

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds; its token increases by one.

        Granted when nobody holds the lease, when it has expired (a takeover: the run's
        ``recoveries`` count increases), or when ``owner`` holds it already.
        """
        now = utc_now()
        with self._write() as conn:
            claimed = self._claim_in(conn, run_id, owner, now, ttl, take_over, None)
        self._remember(claimed)
        return claimed

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases in ONE transaction, each granted or refused on its own.

        For an engine starting many runs at once (``Engine.arun`` with group commit): one
        commit instead of one each. Each run is claimed as by :meth:`claim`; ``check`` is
        called with the run as loaded, first, and what it raises refuses that run. A refused
        run's error is returned at its index and nothing is written for it. When the
        transaction itself fails, nothing was written and every entry is that ``JournalError``.
        """
        now = utc_now()
        results: list[RunRecord | Exception] = []
        try:
            with self._write() as conn:
                for run_id in run_ids:
                    try:
                        results.append(self._claim_in(conn, run_id, owner, now, ttl, None, check))
                    except sqlite3.Error:  # noqa: PERF203 - the transaction failed: every claim
                        raise
                    except Exception as exc:  # noqa: BLE001 - refused alone, returned at its index
                        results.append(exc)
        except JournalError as failure:
            return [failure] * len(run_ids)
        for result in results:
            if isinstance(result, RunRecord):
                self._remember(result)
        return results

    def _claim_in(  # noqa: PLR0917 - one private call shape for claim and claim_many
        self,
        conn: sqlite3.Connection,
        run_id: str,
        owner: str,
        now: dt.datetime,
        ttl: float,
        take_over: str | None,
        check: Callable[[RunRecord], object] | None,
    ) -> RunRecord:
        """One claim inside the caller's write transaction; returns the row it wrote."""
        run = self._load(conn, run_id)
        if check is not None:
            check(run)
        takeover = _lease.grant(run, owner, now, take_over=take_over)
        expires = now + dt.timedelta(seconds=ttl)
        conn.execute(
            "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
            " lease_token = lease_token + 1, recoveries = recoveries + ? WHERE run_id = ?",
            (owner, format_utc(expires), int(takeover), run_id),
        )
        # The row as just written (read inside the same write transaction): no second read.
        return _lease.claimed(run, owner, expires, takeover=takeover)

    def claim_unchanged(self, run: RunRecord, owner: str, *, ttl: float) -> RunRecord | None:
        """Claim ``run``'s lease if the stored run is still as ``run`` shows it; else ``None``.

        One UPDATE, no read: granted only while the run is active with no abort requested, no
        lease held, the lease token ``run`` has and no transition after ``run.seq``. Then the
        stored row is ``run``'s (every write to a run moves its seq, its token or its status),
        so the claim returns ``run`` as claimed. ``None``: nothing was written.
        """
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._write() as conn:
            changed = conn.execute(
                "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
                " lease_token = lease_token + 1 WHERE run_id = ? AND lease_token = ?"
                " AND lease_owner IS NULL AND abort_reason IS NULL AND status = 'active'"
                " AND NOT EXISTS (SELECT 1 FROM transitions AS t"
                " WHERE t.run_key = run_rows.run_key AND t.seq > ?)",
                (owner, format_utc(expires), run.run_id, run.lease_token, run.seq),
            ).rowcount
        if not changed:
            return None
        claimed = _lease.claimed(run, owner, expires, takeover=False)
        self._remember(claimed)
        return claimed

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        machine: str,
        states: Collection[str],
        spec_hash: str | None = None,
    ) -> RunRecord | None:
        """Claim the oldest runnable run (one transaction), or ``None``."""
        if not states:
            return None
        now = utc_now()
        marks = ", ".join("?" * len(states))
        sql = (
            "SELECT run_id, lease_owner FROM runs WHERE status = 'active' AND machine = ?"
            f" AND state IN ({marks}) AND (lease_owner IS NULL OR lease_expires_at < ?)"
        )
        params: list[Any] = [machine, *states, format_utc(now)]
        if spec_hash is not None:
            sql += " AND spec_hash = ?"
            params.append(spec_hash)
        sql += " ORDER BY created_at, run_key LIMIT 1"
        with self._write() as conn:
            found = conn.execute(sql, params).fetchone()
            if found is None:
                return None
            expires = now + dt.timedelta(seconds=ttl)
            conn.execute(
                "UPDATE run_rows SET lease_owner = ?, lease_expires_at = ?,"
                " lease_token = lease_token + 1, recoveries = recoveries + ? WHERE run_id = ?",
                (owner, format_utc(expires), int(found[1] is not None), found[0]),
            )
            return self._load(conn, found[0])

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._write() as conn:
            changed = conn.execute(
                "UPDATE run_rows SET lease_expires_at = ? WHERE run_id = ? AND lease_owner = ?"
                " AND lease_token = ?",
                (format_utc(expires), run_id, owner, token),
            ).rowcount
            if not changed:
                raise self._lease_lost(conn, run_id, token)
        return expires

    def renew_many(
        self, leases: Sequence[tuple[str, int]], owner: str, *, ttl: float
    ) -> dict[str, Renewal]:
        """Renew the ``(run_id, token)`` leases of ``owner`` in ONE transaction (``Journal``)."""
        expires = format_utc(utc_now() + dt.timedelta(seconds=ttl))
        found: dict[str, tuple[str | None, int, str | None, str]] = {}
        with self._write() as conn:
            conn.executemany(
                "UPDATE run_rows SET lease_expires_at = ? WHERE run_id = ? AND lease_owner = ?"
                " AND lease_token = ?",
                [(expires, run_id, owner, token) for run_id, token in leases],
            )
            for start in range(0, len(leases), _IDS_A_STATEMENT):
                run_ids = [run_id for run_id, _ in leases[start : start + _IDS_A_STATEMENT]]
                for run_id, *row in conn.execute(
                    "SELECT run_id, lease_owner, lease_token, abort_reason, status FROM run_rows"
                    f" WHERE run_id IN ({', '.join('?' * len(run_ids))})",
                    run_ids,
                ):
                    found[run_id] = tuple(row)
        return renewals(leases, owner, found)

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it."""
        with self._write() as conn:
            released = conn.execute(
                "UPDATE run_rows SET lease_owner = NULL, lease_expires_at = NULL"
                " WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
                (run_id, owner, token),
            ).rowcount
        return bool(released)

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        _rows.check_fork(run, at_seq)
        first = self._run_params(attrs.evolve(run, seq=0))
        with refused_if_exists(run.run_id), self._write() as conn:
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
                (*self._run_params(run)[1:], run.run_id),
            )
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
        self._remember(run)
        self._remember_key(run.run_id, key)

    def _size(self) -> int | None:
        if self.path == ":memory:":
            return None
        # SQLite follows a symlink and keeps the -wal beside the file it points to.
        real = os.path.realpath(self.path)
        return sum(
            Path(real + suffix).stat().st_size
            for suffix in ("", "-wal")
            if Path(real + suffix).exists()
        )

    def prune(self, *, ended_before: dt.datetime, dry_run: bool = False) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, then ``VACUUM``."""
        # "+c.status": a child is looked up by its parent's id (idx_runs_parent_run_id); by
        # status, SQLite would scan every active run for each ended one, with the write lock
        # held (25 s for 680 ended among 20,000 active runs, while every worker waited).
        select = (
            "SELECT run_id, run_key FROM runs AS r WHERE status != 'active' AND updated_at < ?"
            " AND NOT EXISTS (SELECT 1 FROM run_rows AS c WHERE c.parent_run_id = r.run_id"
            " AND +c.status = 'active') ORDER BY updated_at, run_key"
        )
        cutoff = (format_utc(ended_before),)
        before = self._size()
        if dry_run:
            with self._read() as conn:
                ids = tuple(str(row[0]) for row in conn.execute(select, cutoff))
                count = conn.execute(
                    "SELECT count(*) FROM transitions"
                    f" WHERE run_key IN (SELECT run_key FROM ({select}))",
                    cutoff,
                ).fetchone()[0]
            return PruneReport(ids, int(count), dry_run=True, bytes_before=before)
        with self._write() as conn:
            conn.execute("DROP TABLE IF EXISTS temp.pruned")
            conn.execute(f"CREATE TEMP TABLE pruned AS {select}", cutoff)
            ids = tuple(str(row[0]) for row in conn.execute("SELECT run_id FROM temp.pruned"))
            count = conn.execute(
                "DELETE FROM transitions WHERE run_key IN (SELECT run_key FROM temp.pruned)"
            ).rowcount
            for table in ("iterations", "artifacts", "effects", "run_rows"):
                conn.execute(
                    f"DELETE FROM {table} WHERE run_id IN (SELECT run_id FROM temp.pruned)"
                )
            conn.execute(
                "DELETE FROM specs WHERE spec_hash NOT IN (SELECT DISTINCT spec_hash FROM run_rows)"
            )
            conn.execute("DROP TABLE temp.pruned")
        for run_id in ids:
            self._written.pop(run_id, None)
            self._keys.pop(run_id, None)
        if ids:
            with self._read() as conn:
                # The thread's checkpoint would take the lock that TRUNCATE needs (SQLite does
                # not wait for it): stopped here, started again by the next write.
                self._stop_checkpoints()
                conn.execute("VACUUM")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return PruneReport(ids, count, dry_run=False, bytes_before=before, bytes_after=self._size())

    def integrity_problems(self) -> list[str]:
        """SQLite's ``integrity_check`` and ``foreign_key_check``, one line per problem.

        Then the schema objects that differ from the schema version's
        (:meth:`schema_problems`). Also transitions whose ``run_key`` is not the key of the run
        their ``run_id`` names (only a hand edit makes one: the fence trigger refuses such an
        insert): reads go by ``run_key``, so such a row would show in another run's history.
        """
        schema = self.schema_problems()
        with self._read(damaged=True) as conn:
            problems = [
                f"SQLite integrity check: {row[0]}"
                for row in conn.execute("PRAGMA integrity_check(20)")
                if row[0] != "ok"
            ]
            dangling = conn.execute(
                'SELECT "table", count(*), min(rowid) FROM pragma_foreign_key_check'
                ' GROUP BY "table"'
            ).fetchall()
            miskeyed, first_miskeyed = conn.execute(
                "SELECT count(*), min(t.rowid) FROM transitions AS t"
                " JOIN run_rows AS r ON r.run_id = t.run_id WHERE t.run_key IS NOT r.run_key"
            ).fetchone()
        problems += schema
        problems += [
            f"{count} row(s) of table {table} refer to missing rows (first rowid {first})"
            for table, count, first in dangling
        ]
        if miskeyed:
            problems.append(
                f"{miskeyed} row(s) of table transitions have a run_key that is not their run's"
                f" (first rowid {first_miskeyed})"
            )
        return problems

    def meta(self) -> Mapping[str, str]:
        """The journal's ``meta`` table (schema version, format)."""
        with self._read(damaged=True) as conn:
            return dict(conn.execute("SELECT key, value FROM meta").fetchall())
