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
* **Durable waits**: a run's wake time (``runs.wake_at``) and its signals (``signals``, numbered
  in arrival order) are written under the run's row lock (``put_signal``, ``park``), so a signal
  and a park racing each other always leave the run due when the signal is one its waiting
  state accepts; ``claim_next`` also takes a run whose wake time has come, and ``next_wake``
  is the first entry of an index (``runs_due``). A commit that ends the run clears its wake time.
* **Lost connections** (the server restarted, the backend was terminated, the network dropped)
  are reconnected with backoff for up to ``retry_for`` seconds, then the operation is retried.
  When a write's outcome is unknown — the connection died while its COMMIT was on the wire — the
  journal first looks for what that write would have left (the transition at ``(run_id, seq)``
  with the same lease token, time and event; the lease with the exact expiry it set; ...) and
  takes it as committed, else does it again; the fencing makes doing it again safe.

Opening the journal connects once, without retrying: a wrong URL or password, or a server that
is not there, is reported at once. Passwords never appear in messages or in :attr:`location`.

:class:`PostgresJournal` holds four objects: its connection manager
(:class:`~fsm_runner.journal._postgres_connection.PostgresConnection`: the URL, reconnects,
forks), the SQL it shares with SQLite (:class:`~fsm_runner.journal._sql.SqlCore`), its
fenced writes (:class:`~fsm_runner.journal._postgres_writes.PostgresWriter`) and its releases
and durable waits (:class:`~fsm_runner.journal._postgres_waits.PostgresWaits`). This module
holds the claims (``claim_next``'s in :mod:`~fsm_runner.journal._postgres_claims`), reads and
operations that are PostgreSQL's own.
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import psycopg

from fsm_runner._unclosed import watch
from fsm_runner.exceptions import (
    JournalError,
    RunNotFoundError,
    RunTerminalError,
)
from fsm_runner.journal import _lease, _rows
from fsm_runner.journal._postgres_chain import chain_problems
from fsm_runner.journal._postgres_claims import (
    HEAD_DIGEST,
    ClaimGroup,
    OwnerLiveness,
    claim_group,
    claim_next,
    claim_unchanged_group,
)
from fsm_runner.journal._postgres_connection import (
    DEFAULT_RETRY_FOR,
    DEFAULT_SCHEMA,
    UNRESOLVED,
    Connection,
    PostgresConnection,
    Unresolved,
)
from fsm_runner.journal._postgres_heads import PostgresHeads
from fsm_runner.journal._postgres_schema import SCHEMA_VERSION, integrity_problems, open_schema
from fsm_runner.journal._postgres_url import is_postgres_url, redact
from fsm_runner.journal._postgres_waits import PostgresWaits
from fsm_runner.journal._postgres_writes import (
    PRUNE_BATCH,
    TRANSITION_COLUMNS,
    PostgresWriter,
    utc,
)
from fsm_runner.journal._range_reads import RunRead, read_runs
from fsm_runner.journal._search_indexes import PostgresSearchIndexes
from fsm_runner.journal._sql import SqlCore, SqlDialect, bind_hot_path
from fsm_runner.journal.base import (
    Commit,
    Durability,
    ListFilters,
    NewRun,
    PruneReport,
    Renewal,
    RunFilters,
    claim_each,
    renewals,
)
from fsm_runner.journal.search import postgres_json_match
from fsm_runner.records import (
    ArtifactRecord,
    EffectRecord,
    IterationRecord,
    RunRecord,
    SignalRecord,
    TransitionRecord,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


__all__ = [
    "DEFAULT_RETRY_FOR",
    "DEFAULT_SCHEMA",
    "SCHEMA_VERSION",
    "PostgresJournal",
    "is_postgres_url",
    "redact",
]

_RUN_SELECT = ", ".join(_rows.RUN_COLUMNS)
#: A claim's RETURNING: the run row, then its head digest (its last transition's), which the
#: writer remembers: the claimed run's next commit chains to it without a read of its own.
_CLAIMED = f"{_RUN_SELECT}, {HEAD_DIGEST}"
# FOR SHARE: the run row cannot move on (a commit updates it) until the effect is written.
# The effect's digest (schema 9) is its last value.
_PUT_EFFECT = (
    f"INSERT INTO effects ({', '.join(_rows.EFFECT_COLUMNS)}, digest)"
    f" SELECT {', '.join(['%s'] * (len(_rows.EFFECT_COLUMNS) + 1))}"
    " WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = %s AND seq = %s"
    " AND (%s::bigint IS NULL OR lease_token = %s) FOR SHARE)"
    " ON CONFLICT (run_id, visit_seq, name) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*_rows.EFFECT_COLUMNS[3:], "digest"))
    + ", rowid = DEFAULT"
)
# The active runs the partial indexes ``runs_due`` and ``runs_leased`` hold (as their predicates).
_DUE = "status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL"
_LEASED = "status = 'active' AND lease_owner IS NOT NULL"

_DIALECT = SqlDialect(
    mark="%s",
    run_table="runs",
    run_select=_RUN_SELECT,
    row_order="rowid",
    run_transitions="run_id = %s",
    put_effect=_PUT_EFFECT,
    stamp=utc,
    stale_bound=lambda: ("clock_timestamp()", []),
    json_match=postgres_json_match,
    effect_digests=True,
    # The columns of the ended runs' index and the claims' (ready: its state; due, leased: few
    # runs): a state few runs stand in is a BitmapOr of them; for a common one the planner
    # walks the listing's index newest first until the page is full (1,000,000 runs: 10 ms
    # and 0.2 ms; a set of every match read first took 0.7-1.5 s for a common state).
    state_match=(
        f"(ended_state = %s OR ready_state = %s OR ({_DUE} AND state = %s)"
        f" OR ({_LEASED} AND state = %s))"
    ),
    state_counts=(
        "SELECT ended_state, status, count(*) FROM runs WHERE machine = %s"
        " AND ended_state IS NOT NULL GROUP BY ended_state, status UNION ALL"
        " SELECT ready_state, 'active', count(*) FROM runs WHERE machine = %s"
        " AND ready_state IS NOT NULL GROUP BY ready_state UNION ALL"
        f" SELECT state, status, count(*) FROM runs WHERE machine = %s AND {_DUE}"
        " GROUP BY state, status UNION ALL"
        f" SELECT state, status, count(*) FROM runs WHERE machine = %s AND {_LEASED}"
        " GROUP BY state, status"
    ),
)
#: A transition's columns as :meth:`PostgresJournal.transitions` reads them: with its digest.
_TRANSITION_READ = (*TRANSITION_COLUMNS, "digest")


def _server_now(conn: Connection) -> dt.datetime:
    """The database server's time: leases are set and judged by one clock, whatever the hosts'.

    Workers on several hosts each see a lease expire when the *server's* clock passes it, so a
    host whose own clock runs ahead cannot take over runs that are still held.
    """
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now: dt.datetime = row[0]
    return now


def _claimed(
    writer: PostgresWriter, decode: Callable[[Sequence[Any]], RunRecord], row: Sequence[Any] | None
) -> RunRecord:
    """A claimed run from its row, its head digest after it (remembered by the ``writer``)."""
    assert row is not None
    if len(row) == len(_rows.RUN_COLUMNS):  # a claim found again after a lost connection
        return decode(row)
    run = decode(row[:-1])
    if row[-1] is not None:
        writer.remember_head(run.run_id, run.seq, row[-1])
    return run


class PostgresJournal:
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
        self.durability: Durability = durability
        self._url = url  # for opener(): another process's own connection
        self._connection = connection = PostgresConnection(url, schema=schema, retry_for=retry_for)
        self.schema: str = connection.schema
        try:
            conn = connection.connect()
        except psycopg.Error as exc:
            raise JournalError(
                f"cannot connect to PostgreSQL ({connection.describe(exc)})",
                path=connection.location,
            ) from None
        try:
            open_schema(conn, schema=self.schema, location=connection.location, create=create)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, psycopg.Error):
                raise JournalError(connection.describe(exc), path=connection.location) from None
            raise
        self.search_indexes = indexes = PostgresSearchIndexes(connection)  # serve searches
        self._core = SqlCore(attrs.evolve(_DIALECT, json_match=indexes.json_match), connection)
        self._writer = PostgresWriter(connection, self._core)
        self._waits, self.liveness = PostgresWaits(connection), OwnerLiveness(connection)
        self._claimed = functools.partial(_claimed, self._writer, self._run_from_row)
        self._heads = PostgresHeads(self.location)
        parts = (self._heads, self.liveness.locks, self._writer.remember_head, self._run_from_row)
        self._group = ClaimGroup(*parts, _RUN_SELECT)  # claim_many's
        # The hot path: the writer's own methods bound as this journal's (overrides are kept).
        bind_hot_path(self, PostgresJournal, self._writer, ("commit", "commit_many", "create_runs"))
        self._close = watch(self, functools.partial(_close, self._waits, connection), repr(self))

    @property
    def location(self) -> str:
        """The journal's URL with its schema, without the password."""
        return self._connection.location

    @property
    def retry_for(self) -> float:
        """Seconds an operation keeps trying to get a lost connection back."""
        return self._connection.retry_for

    @retry_for.setter
    def retry_for(self, seconds: float) -> None:
        self._connection.retry_for = seconds

    def close(self) -> None:
        """Close the connection (and the listener's); further use raises ``JournalError``."""
        self._close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, durability={self.durability!r})"

    def __enter__(self) -> PostgresJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def backend_pid(self) -> int | None:
        """The process id of this journal's server backend (``None`` while disconnected)."""
        conn = self._connection.conn
        if conn is None or conn.closed:
            return None
        return int(conn.info.backend_pid)

    def request_abort(self, run_id: str, reason: str) -> RunRecord:
        """Mark an active run as to be aborted; its lease's writes are fenced but for the abort."""

        def work(conn: Connection) -> RunRecord:
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

        return self._connection.call(work)

    # -- writes (PostgresWriter's) ---------------------------------------------------------------

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
        """Store new runs in ONE transaction (:meth:`PostgresWriter.create_runs`)."""
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
        """Store ``transition`` and the run row it leads to (:meth:`PostgresWriter.commit`)."""
        self._writer.commit(
            run, transition, iterations=iterations, artifacts=artifacts, spec_json=spec_json
        )

    def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Store several commits in one transaction (:meth:`PostgresWriter.commit_many`)."""
        return self._writer.commit_many(commits)

    # -- leases --------------------------------------------------------------------------------

    def claim(
        self, run_id: str, owner: str, *, ttl: float, take_over: str | None = None
    ) -> RunRecord:
        """Take the run's lease for ``ttl`` s (its token + 1): a free, expired or own lease.

        Taking over an expired lease, or one whose holder is gone, adds one to ``recoveries``.
        """
        tried: list[dt.datetime] = []  # the expiry each try set: the resolver looks for them

        def work(conn: Connection) -> RunRecord:
            self.liveness.locks.hold(conn, owner)
            with conn.transaction():
                # never driven past a row that fails its digest: verified in the same read,
                # which reads the server's time too
                run, now = self._heads.load(conn, run_id, self._run_from_row)
                expires = now + dt.timedelta(seconds=ttl)
                tried.append(expires)
                takeover = _lease.grant(run, owner, now, take_over=take_over)
                cursor = conn.execute(
                    "UPDATE runs SET lease_owner = %s, lease_expires_at = %s,"
                    " lease_token = lease_token + 1, recoveries = recoveries + %s"
                    f" WHERE run_id = %s RETURNING {_CLAIMED}",
                    (owner, expires, int(takeover), run_id),
                )
                return self._claimed(cursor.fetchone())

        def resolve(conn: Connection) -> RunRecord | Unresolved:
            run = self._load(conn, run_id)
            if run.lease_owner == owner and run.lease_expires_at in tried:
                return run  # the lease this very claim set
            return UNRESOLVED

        return self._connection.call(work, resolve=resolve)

    def claim_unchanged(self, run: RunRecord, owner: str, *, ttl: float) -> RunRecord | None:
        """Claim ``run``'s lease if the stored run is still as ``run`` shows it; else ``None``.

        One UPDATE (its expiry by the server's clock), no read before it: granted only while
        the run is active at ``run.seq`` with ``run``'s lease token, no lease held and no abort
        requested; then its head is read and verified (a run that fails is refused, as by
        :meth:`claim`). ``None``: nothing was written.
        """
        group = self._group
        (claimed,) = claim_unchanged_group(
            self._connection, group, [run], owner, ttl=ttl, refuse=True
        )
        return claimed

    def claim_unchanged_many(
        self, runs: Sequence[RunRecord], owner: str, *, ttl: float
    ) -> list[RunRecord | None]:
        """:meth:`claim_unchanged` of each run, in ONE transaction; ``None`` where not claimed.

        For the runs an engine started and now drives at once (``arun`` of each, grouped):
        one UPDATE of them all and one read of their heads, verified
        (:func:`~._postgres_claims.claim_unchanged_group`).
        """
        return claim_unchanged_group(self._connection, self._group, runs, owner, ttl=ttl)

    def claim_many(
        self,
        run_ids: Sequence[str],
        owner: str,
        *,
        ttl: float,
        check: Callable[[RunRecord], object] | None = None,
    ) -> list[RunRecord | Exception]:
        """Claim several runs' leases in ONE transaction, each granted or refused on its own.

        Four round trips for them all: BEGIN, one read of the runs (locked in id order, their
        head rows verified, the server's time), one UPDATE of the runs granted, COMMIT. A run
        refused (missing, ended, held by another, failing its digest, or by ``check``) gets its
        error at its index and nothing is written for it. After a lost connection, a try that
        did commit is found by the leases' expiry it set (each lease is taken once).
        """
        if len(run_ids) < 2:
            return claim_each(self, run_ids, owner, ttl=ttl, check=check)
        return claim_group(self._connection, self._group, run_ids, owner, ttl=ttl, check=check)

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
        different run and never wait for each other. Its search is index ranges only
        (:func:`~fsm_runner.journal._postgres_claims.claim_next_query`): a run that waits (and is
        not due) or has ended is never read. A run whose wake time has come is runnable
        whatever its state (even with no ``states``).
        """
        return claim_next(
            self._connection,
            self._claimed,
            self._heads,
            owner,
            ttl=ttl,
            machine=machine,
            states=states,
            spec_hash=spec_hash,
            owners=self.liveness.locks,
        )

    def renew(self, run_id: str, owner: str, token: int, *, ttl: float) -> dt.datetime:
        """Extend the lease ``owner`` holds with ``token`` by ``ttl`` seconds from now."""

        def work(conn: Connection) -> dt.datetime:
            expires = _server_now(conn) + dt.timedelta(seconds=ttl)
            changed = conn.execute(
                "UPDATE runs SET lease_expires_at = %s WHERE run_id = %s AND lease_owner = %s"
                " AND lease_token = %s",
                (expires, run_id, owner, token),
            ).rowcount
            if not changed:
                raise self._core.lease_lost(conn, run_id, token)
            return expires

        return self._connection.call(work)  # setting an expiry again is harmless

    def renew_many(
        self, leases: Sequence[tuple[str, int]], owner: str, *, ttl: float
    ) -> dict[str, Renewal]:
        """Renew the ``(run_id, token)`` leases of ``owner`` in ONE transaction (``Journal``)."""
        run_ids, tokens = [run_id for run_id, _ in leases], [token for _, token in leases]

        def work(conn: Connection) -> dict[str, Renewal]:
            self.liveness.locks.hold(conn, owner)  # again after a reconnect
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

        return self._connection.call(work)  # setting expiries again is harmless

    def release(self, run_id: str, owner: str, token: int) -> bool:
        """Give up the lease ``owner`` holds with ``token``; ``False`` if it no longer held it."""
        return self._waits.release(run_id, owner, token)

    # -- durable waits (PostgresWaits') ----------------------------------------------------------

    def park(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        wake_at: dt.datetime | None,
        accepts: Collection[str],
    ) -> bool:
        """Give up the lease and set when the run is due, at once (:meth:`PostgresWaits.park`)."""
        return self._waits.park(run_id, owner, token, wake_at=wake_at, accepts=accepts)

    def wake_time(self, run_id: str) -> dt.datetime | None:
        """Return the run's wake time, if it has one."""
        return self._waits.wake_time(run_id)

    def next_wake(self, *, machine: str) -> dt.datetime | None:
        """The earliest wake time of the machine's active runs nobody holds (one index read)."""
        return self._waits.next_wake(machine=machine)

    def idle(self, *, timeout: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout`` s for a signal's ``NOTIFY`` (:meth:`PostgresWaits.idle`)."""
        return self._waits.idle(timeout=timeout, stop=stop)

    def put_signal(self, signal: SignalRecord) -> SignalRecord:
        """Journal a signal pending for its run (:meth:`PostgresWaits.put_signal`)."""
        return self._waits.put_signal(signal)

    def signals(self, run_id: str, *, pending: bool = False) -> list[SignalRecord]:
        """The run's signals in arrival order (pending ones only, with ``pending``)."""
        return self._waits.signals(run_id, pending=pending)

    def consume_signal(self, run: RunRecord, transition: TransitionRecord, number: int) -> None:
        """Commit the transition and mark signal ``number`` consumed by it, at once."""
        self._writer.consume_signal(run, transition, number)

    # -- operations ----------------------------------------------------------------------------

    def fork_run(self, run: RunRecord, *, source_run_id: str, at_seq: int) -> None:
        """Store ``run`` as a new run whose history is the source run's up to ``at_seq``."""
        self._writer.fork_run(run, source_run_id=source_run_id, at_seq=at_seq)

    def prune(
        self, *, ended_before: dt.datetime, dry_run: bool = False, batch_size: int = PRUNE_BATCH
    ) -> PruneReport:
        """Delete ended runs last updated before ``ended_before``, then ``VACUUM`` the tables.

        ``batch_size`` runs a transaction, found on an index: see
        :meth:`PostgresWriter.prune <fsm_runner.journal._postgres_writes.PostgresWriter.prune>`.
        """
        return self._writer.prune(ended_before=ended_before, dry_run=dry_run, batch_size=batch_size)

    def integrity_problems(self) -> list[str]:
        """Runs off their transitions or with gaps, then rows that do not match their digest.

        See ``_postgres_schema.integrity_problems`` and ``_postgres_chain.chain_problems``.
        """
        return self._connection.call(lambda conn: integrity_problems(conn) + chain_problems(conn))

    def meta(self) -> Mapping[str, str]:
        """The journal's ``meta`` table (schema version, format)."""
        return self._connection.call(
            lambda conn: {
                str(key): str(value)
                for key, value in conn.execute("SELECT key, value FROM meta").fetchall()
            }
        )

    # -- reads ---------------------------------------------------------------------------------

    def load(self, run_id: str) -> RunRecord:
        """Return the run's row (one primary-key lookup; history is not read)."""
        return self._connection.call(lambda conn: self._load(conn, run_id))

    def _load(self, conn: Connection, run_id: str, *, lock: bool = False) -> RunRecord:
        row = conn.execute(
            f"SELECT {_RUN_SELECT} FROM runs WHERE run_id = %s" + (" FOR UPDATE" if lock else ""),
            (run_id,),
        ).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        return self._run_from_row(row)

    def _run_from_row(self, row: Sequence[Any] | None) -> RunRecord:
        assert row is not None
        return self._core.decode_run(dict(zip(_rows.RUN_COLUMNS, row, strict=True)))

    def transitions(
        self, run_id: str, *, from_seq: int = 0, to_seq: int | None = None
    ) -> list[TransitionRecord]:
        """Return the run's transitions with ``from_seq <= seq <= to_seq``, in seq order."""

        def work(conn: Connection) -> list[tuple[Any, ...]]:
            self._core.require_run(conn, run_id)
            return conn.execute(
                f"SELECT {', '.join(_TRANSITION_READ)} FROM transitions"
                " WHERE run_id = %s AND seq >= %s AND seq <= %s ORDER BY seq",
                (run_id, from_seq, to_seq if to_seq is not None else 2**62),
            ).fetchall()

        return self._core.transition_records(_TRANSITION_READ, self._connection.call(work))

    # -- bulk reads (check) --------------------------------------------------------------------

    def check_keys(self, *, since: dt.datetime | None = None) -> list[str]:
        """Every run's id (the transitions' key) in order; with ``since``, runs updated since."""
        return [str(key) for key in self._core.check_keys("run_id", since=since)]

    def read_runs(
        self, first: str, last: str, *, since: dt.datetime | None = None
    ) -> list[RunRead]:
        """The runs with ``first <= run_id <= last``, each read whole (``SqlCore.read_runs``)."""

        def more(run_id: str, start: int, end: int) -> list[TransitionRecord]:
            return self.transitions(run_id, from_seq=start, to_seq=end)

        columns = ", ".join(TRANSITION_COLUMNS)
        return read_runs(self._core, "run_id", columns, first, last, since=since, more=more)

    def opener(self) -> Callable[[], PostgresJournal]:
        """Opens this journal again, only to read it (picklable: for another process)."""
        url, schema = self._url, self.schema
        return functools.partial(PostgresJournal, url, schema=schema, create=False)

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
        """Return runs, newest first, filtered (see :meth:`SqlCore.runs`)."""
        return self._core.runs(**filters)

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


def _close(waits: PostgresWaits, connection: PostgresConnection) -> None:
    """Close a journal's connections: its listener's, then its own."""
    waits.close()
    connection.close()
