"""The SQLite journal: the embedded default, one file that sqlite-utils and Datasette can browse.

Schema and migrations go through ``sqlite-utils``; the hot path (one commit per transition) uses
prepared SQL on the raw connection, in WAL mode, inside ``BEGIN IMMEDIATE`` with a busy timeout
so concurrent writers queue instead of failing with "database is locked".

:class:`SqliteJournal` holds three objects: its connection manager
(:class:`~fsm_runner.journal._sqlite_connections.SqliteConnections`: opening the file, the
lock, reads on a full disk, forks, checkpoints), the SQL it shares with PostgreSQL
(:class:`~fsm_runner.journal._sql.SqlCore`) and its fenced writes
(:class:`~fsm_runner.journal._sqlite_writes.SqliteWriter`). This module holds the reads, claims
and operations that are SQLite's own; the file checks are functions in
:mod:`~fsm_runner.journal._sqlite_check`.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsm_runner._unclosed import watch
from fsm_runner.exceptions import JournalError, RunNotFoundError, RunTerminalError
from fsm_runner.journal import (
    _sqlite_chain,
    _sqlite_check,
    _sqlite_claims,
    _sqlite_prune,
)
from fsm_runner.journal._head import check_stored_id
from fsm_runner.journal._range_reads import RunRead, read_runs
from fsm_runner.journal._search_indexes import SqliteSearchIndexes
from fsm_runner.journal._sql import _IDS_A_STATEMENT, SqlCore, SqlDialect, bind_hot_path
from fsm_runner.journal._sqlite_check import APPLICATION_ID, SCHEMA_VERSION
from fsm_runner.journal._sqlite_connections import TUNING, SqliteConnections
from fsm_runner.journal._sqlite_heads import SqliteHeads
from fsm_runner.journal._sqlite_waits import Names, SqliteWaits, Wake
from fsm_runner.journal._sqlite_writes import PUT_EFFECT, SqliteWriter
from fsm_runner.journal.base import (
    Commit,
    Durability,
    ListFilters,
    NewRun,
    PruneReport,
    Renewal,
    RunFilters,
    renewals,
)
from fsm_runner.journal.search import SearchKey, sqlite_json_match
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    SignalRecord,
    TransitionRecord,
    format_utc,
    utc_now,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


__all__ = ["APPLICATION_ID", "DEFAULT_PATH", "SCHEMA_VERSION", "TUNING", "SqliteJournal"]

#: Where the CLI looks when neither ``--journal`` nor ``FSM_RUNNER_JOURNAL`` is given.
DEFAULT_PATH = "fsm-runner.db"


def _stale_bound() -> tuple[str, list[Any]]:
    return "?", [format_utc(utc_now())]


# The active runs, in the three parts the claims' partial indexes hold: nobody holds them and
# they have no wake time (idx_run_rows_ready), or one (idx_run_rows_due); or leased
# (idx_run_rows_leased). The rows of the first two are their heads; a leased run's is its
# head only through the ``runs`` view (its steps write transitions alone until it is released).
_READY = "status = 'active' AND lease_owner IS NULL AND wake_at IS NULL"
_DUE = "status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL"
_LEASED = "status = 'active' AND lease_owner IS NOT NULL"

_DIALECT = SqlDialect(
    mark="?",
    run_table="run_rows",
    run_select="*",  # the runs view, with run_key
    row_order="run_key",
    run_transitions="run_key = (SELECT run_key FROM run_rows WHERE run_id = ?)",
    put_effect=PUT_EFFECT,
    stamp=format_utc,
    stale_bound=_stale_bound,
    json_match=sqlite_json_match,
    list_by_created=False,
    newest_window=20_000,
    effect_digests=True,
    active_keys=(  # the claims' three indexes: ready, due (a wake time), leased
        f"SELECT run_key FROM run_rows WHERE {_READY} UNION ALL"
        f" SELECT run_key FROM run_rows WHERE {_DUE} UNION ALL"
        f" SELECT run_key FROM run_rows WHERE {_LEASED}"
    ),
    # The ended runs' index (covering: their rows are their heads), the claims' indexes of
    # the active runs nobody holds (so are theirs), and the few leased runs through the view.
    state_match=(
        "run_key IN (SELECT run_key FROM run_rows WHERE status != 'active' AND state = ?"
        f" UNION ALL SELECT run_key FROM run_rows WHERE {_READY} AND state = ?"
        f" UNION ALL SELECT run_key FROM run_rows WHERE {_DUE} AND state = ?"
        " UNION ALL SELECT run_key FROM runs WHERE run_key IN"
        f" (SELECT run_key FROM run_rows WHERE {_LEASED}) AND state = ?)"
    ),
    state_counts=(
        "SELECT state, status, count(*) FROM run_rows WHERE machine = ? AND status != 'active'"
        " GROUP BY state, status UNION ALL"
        f" SELECT state, 'active', count(*) FROM run_rows WHERE machine = ? AND {_READY}"
        " GROUP BY state UNION ALL"
        f" SELECT state, 'active', count(*) FROM run_rows WHERE machine = ? AND {_DUE}"
        " GROUP BY state UNION ALL"
        " SELECT state, status, count(*) FROM runs WHERE run_key IN"
        f" (SELECT run_key FROM run_rows WHERE machine = ? AND {_LEASED}) GROUP BY state, status"
    ),
)

#: The search index a listing by start time is read from, when the journal has it.
_CREATED = SearchKey("created_at")


class SqliteJournal:
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

    #: :meth:`read_runs` verifies the hash chains (``check``: not :meth:`integrity_problems`).
    RANGES_VERIFY_CHAINS = True

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
        self._connections = SqliteConnections(
            self.path,
            durability=durability,
            busy_timeout=busy_timeout,
            create=create,
            checkpoint_thread=checkpoint_thread,
        )
        self._core = SqlCore(_DIALECT, self._connections)
        self._writer = SqliteWriter(self._connections, self._core)
        self._waits = SqliteWaits(self._connections, self._core)
        self.liveness = _sqlite_claims.SqliteLiveness(self._connections)  # who holds leases
        self.search_indexes = SqliteSearchIndexes(self._connections)  # what serves searches
        self._heads = SqliteHeads(self.path)  # a run's head verified before it is driven
        # The hot path: the writer's own methods bound as this journal's (overrides are kept).
        bind_hot_path(self, SqliteJournal, self._writer, ("commit", "commit_many", "create_runs"))
        self._close = watch(self, self._connections.close, repr(self))

    @property
    def location(self) -> str:
        """The journal file's absolute path."""
        return self.path

    def close(self) -> None:
        """Close the connection; further use raises ``JournalError``."""
        self._close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, durability={self.durability!r})"

    def __enter__(self) -> SqliteJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes (SqliteWriter's) ---------------------------------------------------------------

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
        """Store new runs in ONE transaction (:meth:`SqliteWriter.create_runs`)."""
        self._writer.create_runs(runs, spec_json=spec_json)

    def commit(
        self,
        run: RunRecord,
        transition: TransitionRecord,
        *,
        iterations: Sequence[IterationRecord] = (),
        artifacts: Sequence[ArtifactRecord] = (),
        spec_json: str | None = None,
    ) -> None:
        """Store ``transition`` and the run row it leads to (:meth:`SqliteWriter.commit`)."""
        self._writer.commit(
            run, transition, iterations=iterations, artifacts=artifacts, spec_json=spec_json
        )

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one transaction (:meth:`SqliteWriter.commit_many`)."""
        return self._writer.commit_many(commits)

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        self._heads.verify_source(self._connections, source_run_id, at_seq)  # rows it copies
        self._writer.fork_run(run, source_run_id=source_run_id, at_seq=at_seq)

    def prune(
        self, *, ended_before: dt.datetime, dry_run: bool = False, vacuum: bool = False
    ) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, in short batches.

        See :mod:`fsm_runner.journal._sqlite_prune`. ``vacuum``: then give the space back to
        the file system (``VACUUM``: every writer waits for it).
        """
        return _sqlite_prune.prune(
            self._connections,
            self._writer.forget,
            ended_before=ended_before,
            dry_run=dry_run,
            vacuum=vacuum,
        )

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""
        with self._connections.write() as conn:
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
        with self._connections.read() as conn:
            return self._load(conn, run_id)

    def _load(self, conn: sqlite3.Connection, run_id: str, *, verify: bool = False) -> RunRecord:
        """The run's row; with ``verify``, to be driven: its head verified (``SqliteHeads``)."""
        if verify:  # with its head rows, in the same statement
            run = self._heads.load(conn, run_id, self._run_from_row)
        else:
            cursor = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
            row = cursor.fetchone()
            if row is None:
                raise RunNotFoundError(run_id)
            run = self._run_from_row(cursor.description, row)
        self._writer.remember(run)
        return run

    def _run_from_row(self, description: Any, row: Sequence[Any]) -> RunRecord:
        data = {column[0]: value for column, value in zip(description, row, strict=True)}
        key = data.get("run_key")  # the view's: remembered for this journal's commits
        if key is not None:
            self._writer.remember_key(data["run_id"], key)
        return self._core.decode_run(data)

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""
        with self._connections.read() as conn:
            cursor = conn.execute(
                "SELECT * FROM transitions WHERE run_key = ? AND seq >= ? AND seq <= ?"
                " ORDER BY seq",
                (
                    self._writer.stored_key(conn, run_id),
                    from_seq,
                    2**62 if to_seq is None else to_seq,
                ),
            )
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return self._core.transition_records(names, rows)

    # -- bulk reads (check) --------------------------------------------------------------------

    def check_keys(self, *, since: dt.datetime | None = None) -> list[int]:
        """Every run's ``run_key`` in order; with ``since``, of runs updated since then."""
        return self._core.check_keys("run_key", since=since)

    def read_runs(
        self,
        first: int,
        last: int,
        *,
        since: dt.datetime | None = None,
        chains: list[tuple[str, str]] | None = None,
    ) -> list[RunRead]:
        """The runs with ``first <= run_key <= last``, read whole; ``chains``: ``row_breaks``."""

        def more(run_id: str, start: int, end: int) -> list[TransitionRecord]:
            return self.transitions(run_id, from_seq=start, to_seq=end)

        with self._connections.read(damaged=True) as conn:
            rows_read = None if chains is None else _sqlite_chain.verifier(conn, chains)
        return read_runs(
            self._core, "run_key", "*", first, last, since=since, more=more, rows_read=rows_read
        )

    def scan_cache(self, kib: int) -> None:
        """Give this journal's connection a page cache of ``kib`` KiB (for a long scan)."""
        with self._connections.read(damaged=True) as conn:
            conn.execute(f"PRAGMA cache_size = -{int(kib)}")

    def opener(self) -> Callable[[], SqliteJournal]:
        """Opens this journal again, only to read it (picklable: for another process)."""
        path, durability = self.path, self.durability
        return functools.partial(SqliteJournal, path, durability=durability, create=False)

    # -- leases --------------------------------------------------------------------------------

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` seconds; its token increases by one.

        Granted when nobody holds the lease, when it has expired (a takeover: the run's
        ``recoveries`` count increases), or when ``owner`` holds it already.
        """
        now = utc_now()
        with self._connections.write() as conn:
            claimed = _sqlite_claims.claim_in(
                conn, self._load, run_id, owner, now, ttl, take_over, None
            )
        self._writer.remember(claimed)
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
            with self._connections.write() as conn:
                for run_id in run_ids:
                    try:
                        results.append(
                            _sqlite_claims.claim_in(
                                conn, self._load, run_id, owner, now, ttl, None, check
                            )
                        )
                    except sqlite3.Error:  # noqa: PERF203 - the transaction failed: every claim
                        raise
                    except Exception as exc:  # noqa: BLE001 - refused alone, returned at its index
                        results.append(exc)
        except JournalError as failure:
            return [failure] * len(run_ids)
        for result in results:
            if isinstance(result, RunRecord):
                self._writer.remember(result)
        return results

    def claim_unchanged(self, run: RunRecord, owner: str, *, ttl: float) -> RunRecord | None:
        """Claim ``run``'s lease if the stored run is still as ``run`` shows it; else ``None``.

        One UPDATE, no read: granted only while the run is active with no abort requested, no
        lease held, the lease token ``run`` has and no transition after ``run.seq``. Then the
        stored row is ``run``'s (every write to a run moves its seq, its token or its status),
        so the claim returns ``run`` as claimed. ``None``: nothing was written. Its head is not
        verified (as :meth:`claim`'s is): the run is as this journal wrote it, a moment ago.
        """
        claimed = _sqlite_claims.claim_unchanged(self._connections, run, owner, ttl=ttl)
        if claimed is not None:
            self._writer.remember(claimed)
        return claimed

    def claim_unchanged_many(
        self, runs: Sequence[RunRecord], owner: str, *, ttl: float
    ) -> list[RunRecord | None]:
        """:meth:`claim_unchanged` of each run, in ONE transaction; ``None`` where not claimed.

        For the runs an engine started and drives at once (``arun`` of each): one commit, no
        read. A run changed since it was written is ``None``: nothing was written for it.
        """
        claimed = _sqlite_claims.claim_unchanged_many(self._connections, runs, owner, ttl=ttl)
        for run in claimed:
            if run is not None:
                self._writer.remember(run)
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
        """Claim the oldest runnable run (in ``states``, or due), or ``None``; no lock if idle.

        See :func:`fsm_runner.journal._sqlite_claims.claim_next` (index ranges, then one UPDATE).
        """
        # Refused on a journal closed or unwritable (a damaged fence) though an idle poll
        # writes nothing, and (schema version 10) with no states a due run is still claimed.
        self._connections.check_writable()
        claimed = _sqlite_claims.claim_next(
            self._connections,
            self._run_from_row,
            owner,
            ttl=ttl,
            machine=machine,
            states=states,
            spec_hash=spec_hash,
            head_check=self._heads.sound,
            skipped=self._heads.refused,
        )
        if claimed is not None:
            self._writer.remember(claimed)
        return claimed

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""
        expires = utc_now() + dt.timedelta(seconds=ttl)
        with self._connections.write() as conn:
            changed = conn.execute(
                "UPDATE run_rows SET lease_expires_at = ? WHERE run_id = ? AND lease_owner = ?"
                " AND lease_token = ?",
                (format_utc(expires), run_id, owner, token),
            ).rowcount
            if not changed:
                raise self._core.lease_lost(conn, run_id, token)
        return expires

    def renew_many(
        self, leases: Sequence[tuple[str, int]], owner: str, *, ttl: float
    ) -> dict[str, Renewal]:
        """Renew the ``(run_id, token)`` leases of ``owner`` in ONE transaction (``Journal``)."""
        expires = format_utc(utc_now() + dt.timedelta(seconds=ttl))
        found: dict[str, tuple[str | None, int, str | None, str]] = {}
        with self._connections.write() as conn:
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
        """Give up the lease ``owner`` holds with ``token`` (:meth:`SqliteWaits.release`)."""
        return self._waits.release(run_id, owner, token)

    # -- waits (SqliteWaits', schema version 10) ---------------------------------------------

    def park(self, run_id: str, owner: str, token: int, *, wake_at: Wake, accepts: Names) -> bool:
        """Release the lease and set the run's wake time at once (:meth:`SqliteWaits.park`)."""
        return self._waits.park(run_id, owner, token, wake_at=wake_at, accepts=accepts)

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """Return the run's wake time, if it has one (``RunNotFoundError``: no such run)."""
        return self._waits.wake_time(run_id)

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """The earliest wake time of the machine's unleased runs (:meth:`SqliteWaits.next_wake`)."""
        return self._waits.next_wake(machine=machine)

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` s for another connection's commit (:meth:`SqliteWaits.idle`)."""
        return self._waits.idle(timeout=timeout, stop=stop)

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal for its run in ONE transaction (:meth:`SqliteWaits.put_signal`)."""
        check_stored_id(signal.run_id)  # a run under an id that breaks the rule is read-only
        return self._waits.put_signal(signal)

    def signals(self, run_id: str, *, pending: bool = False) -> list[SignalRecord]:
        """Return the run's signals in arrival order (pending ones only, with ``pending``)."""
        return self._waits.signals(run_id, pending=pending)

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """:meth:`commit` and mark the signal consumed (:meth:`SqliteWriter.consume_signal`)."""
        self._writer.consume_signal(run, transition, number)

    # -- checks --------------------------------------------------------------------------------

    def schema_problems(self) -> list[str]:
        """How the journal's schema objects differ from those of its schema version.

        See :func:`fsm_runner.journal._sqlite_check.schema_problems`; empty for a journal as
        fsm_runner made (or migrated) it.
        """
        with self._connections.read(damaged=True) as conn:
            return _sqlite_check.schema_problems(conn)

    def integrity_problems(self, *, chains: bool = True) -> list[str]:
        """SQLite's ``integrity_check`` and ``foreign_key_check``, one line per problem.

        Then the schema objects that differ from the schema version's
        (:meth:`schema_problems`), transitions filed under another run's ``run_key``, the
        digests, and the runs' hash chains unless ``chains=False`` (:meth:`read_runs`'s).
        """
        with self._connections.read(damaged=True) as conn:
            return _sqlite_check.integrity_problems(conn, chains=chains)

    def meta(self) -> Mapping[str, str]:
        """The journal's ``meta`` table (schema version, format)."""
        with self._connections.read(damaged=True) as conn:
            return dict(conn.execute("SELECT key, value FROM meta").fetchall())

    # -- what both SQL journals share (SqlCore's) ----------------------------------------------

    def effect(self, run_id: str, visit_seq: int, name: str) -> EffectRecord | None:
        """Return the effect recorded under that name in that visit, if any."""
        return self._core.effect(run_id, visit_seq, name)

    def effects(self, run_id: str) -> list[EffectRecord]:
        """Return the run's effects, in the order they were started."""
        return self._core.effects(run_id)

    def put_effect(
        self, record: EffectRecord, *, run_seq: int, lease_token: int | None = None
    ) -> None:
        """Store ``record`` only while the run is at ``run_seq`` (:meth:`SqlCore.put_effect`)."""
        self._core.put_effect(record, run_seq=run_seq, lease_token=lease_token)

    def iteration(self, run_id: str, iteration: int) -> IterationRecord | None:
        """Return the run's record of that iteration, if there is one."""
        return self._core.iteration(run_id, iteration)

    def iterations(self, run_id: str) -> list[IterationRecord]:
        """Return the run's iteration records, in iteration order."""
        return self._core.iterations(run_id)

    def artifacts(self, run_id: str) -> list[ArtifactRecord]:
        """Return the run's artifacts, in the order they were committed."""
        return self._core.artifacts(run_id)

    def runs(self, **filters: Unpack[ListFilters]) -> list[RunRecord]:
        """Return runs, newest first, filtered (see :meth:`SqlCore.runs`).

        A search by start time is listed by ``created_at`` once its search index is there
        (read from it), else in key order (the runs newest first, until a page is full).
        """
        search = filters.get("search")
        by_created = search is not None and search.ranged and self.search_indexes.serves(_CREATED)
        return self._core.runs(by_created=by_created, **filters)

    def count_runs(self, *, at_most: int | None = None, **filters: Unpack[RunFilters]) -> int:
        """How many runs :meth:`runs` would list with these filters (``Journal``)."""
        return self._core.count_runs(at_most=at_most, **filters)

    def run_counts(self, *, machine: str) -> dict[tuple[str, str], int]:
        """Return how many runs of ``machine`` there are per (state, status), now."""
        return self._core.run_counts(machine=machine)

    def transition_counts(self, run_id: str) -> list[tuple[str | None, str, str, int, int]]:
        """How often the run took each move: ``(from, event, to, count, last seq)``, by last seq."""
        return self._core.transition_counts(run_id)

    def run_ids(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Return up to ``limit`` run ids that start with ``prefix``."""
        return self._core.run_ids(prefix, limit=limit)

    def spec_json(self, spec_hash: str) -> str:
        """Return the canonical JSON of the spec with that hash."""
        return self._core.spec_json(spec_hash)

    def release_many(self, leases: Sequence[tuple[str, int]], owner: str) -> dict[str, str | None]:
        """Give up the ``(run_id, token)`` leases ``owner`` holds, in one write (``Journal``)."""
        return self._core.release_many(leases, owner)
