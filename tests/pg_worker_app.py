"""The worker app of the PostgreSQL multi-process tests (``tests/test_postgres_workers.py``).

The machine is the crash torture's (``tests/torture.py``: fetching → building → testing →
signing → publishing → published, with rebuild loops and two failing terminals), so every
run's exact path follows from its input. Its phase handlers record each execution in an
``executions`` table of the journal's own PostgreSQL schema — ``id, run_id, state, visit_seq,
lease_token, worker, pid, work_ms, started_at, finished_at`` — through a connection of their own
to the same database: a row is inserted when the phase starts (under the lease token the
phase runs with) and ``finished_at`` is set just before the handler returns its event, each in
its own transaction with ``synchronous_commit = on``, so a row the phase wrote survives a crash
of the server as the journal's transitions do. Times are the server's clock when the write
lands. A write cut off by a lost connection is done again on a new one (the row's id is made
here, so doing it again never doubles it).

Workers run it through the CLI, as on any host::

    FSM_PG_WORKER_URL=postgresql://root@127.0.0.1/test FSM_PG_WORKER_SCHEMA=s1 \\
        fsm-runner --journal 'postgresql://root@127.0.0.1/test?schema=s1' \\
        worker --app tests.pg_worker_app:make_engine

``FSM_PG_WORKER_LEASE_TTL`` and ``FSM_PG_WORKER_HEARTBEAT`` set the engine's lease (seconds).

:func:`verify` checks a finished session: every run at its expected end by its expected path,
gapless seqs, ``check_journal``, and no completed phase executed twice — as
:func:`tests.torture.verify` does for the SQLite journal.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from fsm_runner import Engine, MemoryJournal
from tests.torture import PHASES, SPEC, check_executions, decide

__all__ = [
    "LONG_MS",
    "PHASES",
    "SPEC",
    "Executions",
    "Report",
    "make_engine",
    "make_input",
    "verify",
]

#: Milliseconds a phase may take: mostly nothing, sometimes long enough to be killed inside.
LONG_MS = 40
WORK_MS = (0, 0, 0, 0, 0, 1, 2, LONG_MS)
#: Seconds a side-table write waits for a lost connection to come back (a server restart).
RETRY_FOR = 60.0
EXECUTIONS_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    id text PRIMARY KEY,
    run_id text NOT NULL,
    state text NOT NULL,
    visit_seq bigint NOT NULL,
    lease_token bigint NOT NULL,
    worker text NOT NULL,
    pid integer NOT NULL,
    work_ms integer NOT NULL,
    started_at double precision NOT NULL,
    finished_at double precision
)
"""
#: When a write lands (the server's clock: the same host's as the test's ``time.time()``); a
#: write done again after a lost connection is stamped when it finally lands.
_NOW = sql.SQL("extract(epoch FROM clock_timestamp())")
_COLUMNS = (
    "id, run_id, state, visit_seq, lease_token, worker, pid, work_ms, started_at, finished_at"
)


def make_input(rng: random.Random) -> dict[str, Any]:
    """A run's input: its outcome, how often testing asks for a rebuild, each phase's duration."""
    return {
        "outcome": rng.choices(["published", "failed", "canceled"], weights=[6, 2, 2])[0],
        "rebuilds": rng.choice([0, 0, 0, 1, 2]),
        "work_ms": {phase: rng.choice(WORK_MS) for phase in PHASES},
    }


@dataclasses.dataclass(frozen=True)
class Execution:
    """One row of the ``executions`` table: one phase execution."""

    id: str
    run_id: str
    state: str
    visit_seq: int
    lease_token: int
    worker: str
    pid: int
    work_ms: int
    started_at: float
    finished_at: float | None


class Executions:
    """The ``executions`` side table in the journal's schema, through a connection of its own.

    Every statement runs in autocommit mode with ``synchronous_commit = on``; one that meets a
    lost connection is run again on a new connection, for up to ``retry_for`` seconds.
    """

    def __init__(self, url: str, schema: str, *, retry_for: float = RETRY_FOR) -> None:
        self._url = url
        self._table = sql.Identifier(schema, "executions")
        self._retry_for = retry_for
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
            self._conn.execute("SET synchronous_commit TO on")
        return self._conn

    def execute(self, statement: sql.Composed | sql.SQL, params: Sequence[Any] = ()) -> list[Any]:
        """Run one statement (again on a new connection if its connection was lost)."""
        deadline = time.monotonic() + self._retry_for
        while True:
            try:
                cursor = self._connection().execute(statement, params)
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:  # noqa: PERF203 - a retry loop, by design
                if time.monotonic() > deadline or not (
                    self._conn is None or self._conn.closed or self._conn.broken
                ):
                    raise
                time.sleep(0.05)

    def create(self) -> None:
        """Create the table (once, before any worker runs)."""
        self.execute(sql.SQL(EXECUTIONS_DDL).format(table=self._table))

    def started(self, run: Any) -> str:
        """Record that the phase of ``run``'s state starts; return the row's id."""
        execution_id = uuid.uuid4().hex
        self.execute(
            sql.SQL(
                "INSERT INTO {} (id, run_id, state, visit_seq, lease_token, worker, pid, work_ms,"
                " started_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, {now})"
                " ON CONFLICT (id) DO NOTHING"
            ).format(self._table, now=_NOW),
            (
                execution_id,
                run.run_id,
                run.state,
                run.visit_seq,
                run.lease_token,
                run.lease_owner or "",
                os.getpid(),
                run.input["work_ms"][run.state],
            ),
        )
        return execution_id

    def finished(self, execution_id: str) -> None:
        """Record that the phase is about to return its event."""
        self.execute(
            sql.SQL("UPDATE {} SET finished_at = coalesce(finished_at, {}) WHERE id = %s").format(
                self._table, _NOW
            ),
            (execution_id,),
        )

    def all(self) -> list[Execution]:
        """Every execution, in the order they started."""
        rows = self.execute(
            sql.SQL(f"SELECT {_COLUMNS} FROM {{}} ORDER BY started_at, id").format(self._table)
        )
        return [Execution(*row) for row in rows]

    def find(self, execution_id: str) -> Execution:
        """The execution with that id."""
        rows = self.execute(
            sql.SQL(f"SELECT {_COLUMNS} FROM {{}} WHERE id = %s").format(self._table),
            (execution_id,),
        )
        return Execution(*rows[0])

    def running(self, pid: int, *, at_least_ms: int) -> list[Execution]:
        """The executions of process ``pid`` not finished yet that take ``at_least_ms``."""
        rows = self.execute(
            sql.SQL(
                f"SELECT {_COLUMNS} FROM {{}} WHERE pid = %s AND finished_at IS NULL"
                " AND work_ms >= %s"
            ).format(self._table),
            (pid, at_least_ms),
        )
        return [Execution(*row) for row in rows]

    def close(self) -> None:
        """Close the connection."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Recorder:
    """Phase handlers that record each execution (see the module doc), then return its event."""

    def __init__(self, executions: Executions) -> None:
        self.executions = executions
        self.handlers = dict.fromkeys(PHASES, self.run_phase)

    def run_phase(self, ctx: Any) -> str:
        """Record the start, take the input's time for this phase, record the end."""
        run = ctx.run
        execution_id = self.executions.started(run)
        work_ms = run.input["work_ms"][run.state]
        if work_ms:
            time.sleep(work_ms / 1000.0)
        event = decide(run.state, run.input, run.seq)
        self.executions.finished(execution_id)
        return event


def make_engine() -> Engine:
    """The app's engine (``--app tests.pg_worker_app:make_engine``); the CLI gives the journal."""
    lease_ttl = float(os.environ.get("FSM_PG_WORKER_LEASE_TTL", "30"))
    heartbeat = os.environ.get("FSM_PG_WORKER_HEARTBEAT")
    executions = Executions(os.environ["FSM_PG_WORKER_URL"], os.environ["FSM_PG_WORKER_SCHEMA"])
    return Engine(
        SPEC,
        handlers=Recorder(executions).handlers,
        journal=MemoryJournal(),
        lease_ttl=lease_ttl,
        heartbeat_interval=float(heartbeat) if heartbeat else None,
        max_recoveries=10**9,  # nothing is parked: every run must reach its own end
    )


# -- the checks ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """What :func:`verify` found; ``problems`` is empty when every check passed."""

    runs: int = 0
    transitions: int = 0
    executions: int = 0
    #: Executions beyond one per journaled visit (the phase ran again: at-least-once).
    re_executions: int = 0
    #: The visits that ran more than once: ``(run_id, state, visit_seq)`` -> their executions.
    re_executed: dict[tuple[str, str, int], list[Execution]] = dataclasses.field(
        default_factory=dict
    )
    #: Executions that finished but whose result was never journaled (a later token's was).
    lost_results: list[Execution] = dataclasses.field(default_factory=list)
    #: Executions that never finished (their process was killed inside the phase).
    unfinished: list[Execution] = dataclasses.field(default_factory=list)
    #: Lease takeovers (``runs.recoveries``, summed) and the runs that had any.
    recoveries: int = 0
    taken_over: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """The figures, then the first problems."""
        lines = [
            f"runs {self.runs}, transitions {self.transitions}, phase executions"
            f" {self.executions}, re-executions {self.re_executions} (unfinished"
            f" {len(self.unfinished)}, finished but not journaled {len(self.lost_results)}),"
            f" recoveries {self.recoveries} on {len(self.taken_over)} run(s),"
            f" problems {len(self.problems)}"
        ]
        lines += [f"  {problem}" for problem in self.problems[:20]]
        return "\n".join(lines)


def verify(
    journal: Any, executions: Collection[Execution], inputs: Mapping[str, Mapping[str, Any]]
) -> Report:
    """Check a finished session's journal against its inputs and its phase executions.

    The checks are the SQLite torture's (:func:`tests.torture.check_executions`): every run at
    its expected end by its expected path, gapless, ``check_journal`` clean; no completed phase
    executed twice; executions under earlier tokens (a phase run again after its worker was
    lost) listed for the caller to match with what it did to the workers.
    """
    checked = check_executions(journal, executions, inputs)
    return Report(
        runs=len(inputs),
        transitions=checked.transitions,
        executions=len(executions),
        re_executions=checked.re_executions,
        re_executed=checked.re_executed,
        lost_results=[e for e in checked.earlier if e.finished_at is not None],
        unfinished=[e for e in checked.earlier if e.finished_at is None],
        recoveries=checked.recoveries,
        taken_over=checked.taken_over,
        problems=checked.problems,
    )
