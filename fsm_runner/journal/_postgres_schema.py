"""The PostgreSQL journal's schema: opening it, and its migrations, as plain SQL.

:func:`open_schema` finds the journal in its PostgreSQL schema, refuses a foreign or newer one,
and creates or migrates it (for :class:`~fsm_runner.journal.postgres.PostgresJournal`, as it
opens).

Versions 1 to 5 are the SQLite journal's (:mod:`fsm_runner.journal._schema`); since then each
medium numbers its own migrations (PostgreSQL's 6, the abort fence, is SQLite's 8). Both store
the same records, so a record written by one reads back the same from the other. Migrations
are frozen once released: a change of schema is a new migration, never an edit of an old one.
A migration may have a step in Python (:data:`PYTHON_STEPS`), run right after its SQL: version
9's computes the digests of the rows a journal holds (PostgreSQL has no BLAKE2b).
Each migration runs inside the transaction that opens the journal, under an advisory lock, so
two processes opening a new schema at once create it once. What only
PostgreSQL's claims and prunes search (migration 7's generated columns ``ready_state`` and
``ended_at``, and the partial indexes over them) is never read into a record; nor is a run's
wake time (migration 8's ``wake_at``), which only ``wake_time`` and ``next_wake`` read.

Types: ``bigint`` for seqs, tokens and counts; ``timestamptz`` for times (microseconds, like the
ISO text the SQLite journal stores); ``text`` for JSON payloads, holding exactly the JSON the
SQLite journal stores (``jsonb`` would reorder keys and refuse what ``json.dumps`` writes for
``NaN``), so records round-trip unchanged — cast to ``jsonb`` to query them. Run ids use the
``"C"`` collation: they sort and compare by code point, as in SQLite. Foreign keys are enforced.
``rowid`` columns keep insertion order, as SQLite's implicit rowid does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from fsm_runner.exceptions import JournalError, SchemaVersionError
from fsm_runner.journal._postgres_chain import fill_signal_digests, m0009_fill_digests
from fsm_runner.journal._postgres_connection import Connection

__all__ = ["MIGRATIONS", "PYTHON_STEPS", "SCHEMA_VERSION", "integrity_problems", "open_schema"]

#: What the ``meta`` table's ``format`` row says in every fsm_runner journal.
_FORMAT: Final = "fsm_runner journal"

#: The schema version this fsm_runner writes; a schema with a higher one is refused.
SCHEMA_VERSION = 11

_M0001_INITIAL = """
CREATE TABLE meta (key text PRIMARY KEY, value text);
CREATE TABLE specs (
    spec_hash text COLLATE "C" PRIMARY KEY,
    machine text,
    json text,
    created_at timestamptz
);
CREATE TABLE runs (
    run_id text COLLATE "C" PRIMARY KEY,
    machine text NOT NULL,
    spec_hash text COLLATE "C" NOT NULL REFERENCES specs (spec_hash),
    state text NOT NULL,
    status text NOT NULL,
    seq bigint NOT NULL,
    iteration bigint NOT NULL DEFAULT 0,
    attempt bigint NOT NULL DEFAULT 1,
    input text,
    context text,
    error text,
    created_at timestamptz NOT NULL,
    updated_at timestamptz,
    parent_run_id text COLLATE "C",
    forked_from text,
    abort_reason text,
    lease_owner text,
    lease_expires_at timestamptz,
    lease_token bigint NOT NULL DEFAULT 0,
    rowid bigint GENERATED ALWAYS AS IDENTITY UNIQUE
);
CREATE INDEX runs_machine_created_at ON runs (machine, created_at);
CREATE INDEX runs_status_created_at ON runs (status, created_at);
CREATE INDEX runs_created_at ON runs (created_at, rowid);
CREATE INDEX runs_parent_run_id ON runs (parent_run_id);
CREATE TABLE transitions (
    run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id),
    seq bigint NOT NULL,
    from_state text,
    event text NOT NULL,
    to_state text NOT NULL,
    iteration bigint,
    attempt bigint,
    at timestamptz NOT NULL,
    duration_ms double precision,
    result text,
    PRIMARY KEY (run_id, seq)
);
INSERT INTO meta (key, value) VALUES ('schema_version', '1'), ('format', 'fsm_runner journal');
"""

_M0002_ITERATIONS_ARTIFACTS = """
CREATE TABLE iterations (
    run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id),
    iteration bigint NOT NULL,
    state text,
    started_at timestamptz,
    completed_at timestamptz,
    duration_ms double precision,
    snapshot_id text,
    feedback text,
    feedback_fallback boolean,
    agent_session_id text,
    agent_result_ref text,
    agent_duration_ms double precision,
    success boolean,
    model text,
    tokens_input bigint,
    tokens_output bigint,
    tokens_total bigint,
    cost_usd double precision,
    verification_ref text,
    passed boolean,
    levels_run text,
    verification_duration_ms double precision,
    error_type text,
    error_message text,
    error_details text,
    extra text,
    PRIMARY KEY (run_id, iteration)
);
CREATE TABLE artifacts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id),
    name text NOT NULL,
    kind text,
    seq bigint,
    iteration bigint,
    status text,
    path text,
    sha256 text,
    size bigint,
    error text,
    content text,
    created_at timestamptz,
    UNIQUE (run_id, name)
);
UPDATE meta SET value = '2' WHERE key = 'schema_version';
"""

_M0003_RETURN_TARGETS = """
ALTER TABLE runs ADD COLUMN return_to text, ADD COLUMN return_attempt bigint NOT NULL DEFAULT 0;
UPDATE meta SET value = '3' WHERE key = 'schema_version';
"""

_M0004_EFFECTS = """
ALTER TABLE runs ADD COLUMN visit_seq bigint NOT NULL DEFAULT 0,
                 ADD COLUMN return_visit bigint NOT NULL DEFAULT 0;
UPDATE runs SET visit_seq = seq;
CREATE TABLE effects (
    run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id),
    visit_seq bigint NOT NULL,
    name text NOT NULL,
    state text,
    kind text,
    params text,
    idempotency_key text,
    status text,
    result text,
    error text,
    idempotent boolean,
    started_at timestamptz,
    completed_at timestamptz,
    rowid bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    PRIMARY KEY (run_id, visit_seq, name)
);
CREATE INDEX effects_status ON effects (status);
UPDATE meta SET value = '4' WHERE key = 'schema_version';
"""

_M0005_LEASES = """
ALTER TABLE transitions ADD COLUMN lease_token bigint NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN recoveries bigint NOT NULL DEFAULT 0;
CREATE INDEX runs_status_lease_expires_at ON runs (status, lease_expires_at);
CREATE INDEX runs_status_machine_created_at ON runs (status, machine, created_at, rowid);
UPDATE meta SET value = '5' WHERE key = 'schema_version';
"""

# The lease token that was the run's when its abort was requested: a commit under it (or an older
# one) that is not the USER_ABORTED carrying the abort out is refused (see the SQLite journal's
# m0008_abort_fence).
_M0006_ABORT_FENCE = """
ALTER TABLE runs ADD COLUMN abort_token bigint;
UPDATE runs SET abort_token = lease_token WHERE abort_reason IS NOT NULL AND status = 'active';
UPDATE meta SET value = '6' WHERE key = 'schema_version';
"""

# What a claim and a prune search, kept in the run row only where it matters, so that both are
# one index range (issue 28). Both are generated columns: PostgreSQL computes them on every write
# of the row, whichever statement makes it (claims, releases, commits, operations, and SQL the
# journal shares with SQLite), so no write can leave them stale. A plain step of a leased run
# changes neither (``ready_state`` stays NULL while leased, ``ended_at`` while active), and no
# index holds a column a plain step changes (state, seq, iteration, updated_at, visit_seq), so a
# step's UPDATE stays a HOT update that writes no index. ``ready_state``: the state of an active
# run nobody holds (claimable if a handler runs it). ``ended_at``: when an ended run was last
# updated (what prune's cutoff compares). ``runs_spec_hash`` serves the foreign key when prune
# deletes a spec no run uses any more (without it each such delete read every run). The
# fillfactor leaves room in each page of runs for the next version of its rows: a HOT update
# needs it on the row's own page (2,000 runs claimed then stepped three times, beside a long
# transaction that keeps pages from being pruned: 0 of 6,000 step updates HOT at 100, 744 at 90).
_M0007_CLAIM_PRUNE_INDEXES = """
ALTER TABLE runs SET (fillfactor = 90);
ALTER TABLE runs
    ADD COLUMN ready_state text GENERATED ALWAYS AS
        (CASE WHEN status = 'active' AND lease_owner IS NULL THEN state END) STORED,
    ADD COLUMN ended_at timestamptz GENERATED ALWAYS AS
        (CASE WHEN status <> 'active' THEN updated_at END) STORED;
CREATE INDEX runs_ready ON runs (machine, ready_state, created_at, rowid)
    WHERE ready_state IS NOT NULL;
CREATE INDEX runs_leased ON runs (machine, lease_expires_at)
    WHERE status = 'active' AND lease_owner IS NOT NULL;
CREATE INDEX runs_ended ON runs (ended_at, rowid) WHERE ended_at IS NOT NULL;
CREATE INDEX runs_spec_hash ON runs (spec_hash);
DROP INDEX runs_status_lease_expires_at;
UPDATE meta SET value = '7' WHERE key = 'schema_version';
"""

# Durable waits (issue 29). ``wake_at``: when a claim offers the run whatever its state (a
# signal came, or its wait's deadline); set by ``park`` and ``put_signal``, cleared by the commit
# that ends the run. ``runs_due`` holds only the active runs nobody holds that have one, keyed
# by ``(machine, wake_at)``: the runs due are one range of it, the next wake time its first
# entry. A plain step changes none of its columns (``wake_at`` is never written by one), so a
# step stays a HOT update. ``ready_state`` is made again to be NULL while the run has a wake
# time: a run its phase parked (``ctx.wait_for``, ``ctx.sleep_until``)
# stands in a handler's state but is not runnable before its wake time. ``signals``: each
# run's mailbox, numbered in arrival order (a run's
# signals are numbered under its row lock); pending while ``consumed_seq`` is NULL (expired if
# the run ended); at most one signal per ``(run, signal_id)``.
_M0008_WAITS = """
ALTER TABLE runs ADD COLUMN wake_at timestamptz;
ALTER TABLE runs DROP COLUMN ready_state;
ALTER TABLE runs ADD COLUMN ready_state text GENERATED ALWAYS AS
    (CASE WHEN status = 'active' AND lease_owner IS NULL AND wake_at IS NULL THEN state END)
    STORED;
CREATE INDEX runs_ready ON runs (machine, ready_state, created_at, rowid)
    WHERE ready_state IS NOT NULL;
CREATE INDEX runs_due ON runs (machine, wake_at)
    WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL;
CREATE TABLE signals (
    number bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id text COLLATE "C" NOT NULL REFERENCES runs (run_id),
    name text NOT NULL,
    payload text,
    signal_id text,
    received_at timestamptz NOT NULL,
    consumed_seq bigint,
    consumed_at timestamptz
);
CREATE INDEX signals_run_id_number ON signals (run_id, number);
CREATE UNIQUE INDEX signals_run_id_signal_id ON signals (run_id, signal_id)
    WHERE signal_id IS NOT NULL;
UPDATE meta SET value = '8' WHERE key = 'schema_version';
"""

# A hash chain per run (issue 30; the SQLite journal's migration 11): each transition's digest
# chains it to the run's previous one; the run row, iterations, effects and artifacts carry a
# digest of their own values (see fsm_runner.journal._digest and ._postgres_chain). The writers
# compute them in Python and bind them in the statements they already run; no index holds a
# digest (a step's UPDATE of the run row, which rewrites its digest, stays a HOT update). The
# rows a journal holds when it is migrated get theirs from the Python step of this version
# (PYTHON_STEPS: PostgreSQL has no BLAKE2b), which records in meta when and up to which run.
_M0009_DIGESTS = """
ALTER TABLE transitions ADD COLUMN digest text;
ALTER TABLE runs ADD COLUMN digest text;
ALTER TABLE iterations ADD COLUMN digest text;
ALTER TABLE effects ADD COLUMN digest text;
ALTER TABLE artifacts ADD COLUMN digest text;
UPDATE meta SET value = '9' WHERE key = 'schema_version';
"""

# How many runs stand in each state, and which (issue 32; the SQLite journal's migration 12).
# ``ended_state``: an ended run's state, a generated column NULL while the run is active (a plain
# step changes neither it nor any other indexed column: it stays a HOT update), under an index of
# the ended runs by state, machine and status: a listing by state reads one range of it and of
# the claims' indexes (``runs_ready`` holds the state of the active runs nobody holds; the few
# due or leased runs are read from theirs) instead of every run, and a machine's counts per state
# and status read those indexes alone (this one whole: PostgreSQL before 18 has no skip scan).
# And each signal's digest (issue 30): what its sender wrote, computed with it by the writer;
# the signals a journal holds get theirs from this version's Python step.
_M0010_OUTCOMES = """
ALTER TABLE runs ADD COLUMN ended_state text GENERATED ALWAYS AS
    (CASE WHEN status <> 'active' THEN state END) STORED;
CREATE INDEX runs_outcomes ON runs (ended_state, machine, status) WHERE ended_state IS NOT NULL;
ALTER TABLE signals ADD COLUMN digest text;
UPDATE meta SET value = '10' WHERE key = 'schema_version';
"""

# Fewer index entries a step (issue 33). A step rewrites its run's row; the new version goes on
# the same page only if the page has room for it (a HOT update: no index written), else to
# another page, and then every index of runs gets an entry for it. A group commit rewrites every
# row of a page in one transaction, so a page needs room for a second version of each of its
# rows: at fillfactor 90, 36 % of a group's updates were HOT (1,000 runs stepped at once, 4-step
# runs), at 50, 74 %, and the server's CPU fell from ~40 to ~24 us a step (the WAL a step from
# ~1,390 to ~820 bytes). It applies to the pages written from now on (``VACUUM FULL runs``
# rewrites the others). And the parent's index holds only the runs that have one: a run with
# none (most) is no entry in it, at its start or at an update that is not HOT.
_M0011_STEP_PAGES = """
ALTER TABLE runs SET (fillfactor = 50);
DROP INDEX runs_parent_run_id;
CREATE INDEX runs_parent_run_id ON runs (parent_run_id) WHERE parent_run_id IS NOT NULL;
UPDATE meta SET value = '11' WHERE key = 'schema_version';
"""

#: ``(version, name, SQL)``, in order; a journal at version N lacks every migration above N.
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "m0001_initial", _M0001_INITIAL),
    (2, "m0002_iterations_artifacts", _M0002_ITERATIONS_ARTIFACTS),
    (3, "m0003_return_targets", _M0003_RETURN_TARGETS),
    (4, "m0004_effects", _M0004_EFFECTS),
    (5, "m0005_leases", _M0005_LEASES),
    (6, "m0006_abort_fence", _M0006_ABORT_FENCE),
    (7, "m0007_claim_prune_indexes", _M0007_CLAIM_PRUNE_INDEXES),
    (8, "m0008_waits", _M0008_WAITS),
    (9, "m0009_digests", _M0009_DIGESTS),
    (10, "m0010_outcomes", _M0010_OUTCOMES),
    (11, "m0011_step_pages", _M0011_STEP_PAGES),
)
assert MIGRATIONS[-1][0] == SCHEMA_VERSION
#: A migration's step in Python, run right after its SQL (in the same transaction): what SQL
#: alone cannot compute.
PYTHON_STEPS: Mapping[int, Callable[[Connection], None]] = {
    9: m0009_fill_digests,
    10: fill_signal_digests,
}


def open_schema(conn: Connection, *, schema: str, location: str, create: bool) -> None:
    """Open the journal in ``schema`` on ``conn``: create it, or migrate it, as needed.

    Raises:
        JournalError: the schema holds no journal (``create`` false) or somebody else's tables.
        SchemaVersionError: a newer fsm_runner wrote it.
    """
    try:
        rows = conn.execute(
            "SELECT key, value FROM meta WHERE key IN ('schema_version', 'format')"
        ).fetchall()
    except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn):
        rows = None  # no journal here yet, or somebody else's meta table: look closer
    if rows is not None:
        meta: dict[Any, Any] = dict(rows)
        if meta.get("format") == _FORMAT and _version(meta, location) == SCHEMA_VERSION:
            return  # the common case: an up-to-date journal, opened without a lock
    lock_key = zlib.crc32(f"fsm_runner schema {schema}".encode())
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key,))
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
        if found is None:
            if not create:
                raise JournalError(
                    f"holds no fsm_runner journal (there is no schema {schema!r})", path=location
                )
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        tables = {
            str(row[0])
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
            )
        }
        version = _stored_version(conn, tables, schema=schema, location=location, create=create)
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(found=version, supported=SCHEMA_VERSION, path=location)
        _migrate(conn, version)


def _migrate(conn: Connection, version: int) -> None:
    """Run every migration above ``version``: their SQL joined, up to each Python step."""
    pending = ""
    for number, _name, text in MIGRATIONS:
        if number <= version:
            continue
        pending += text
        step = PYTHON_STEPS.get(number)
        if step is not None:
            conn.execute(pending)
            pending = ""
            step(conn)
    if pending:
        conn.execute(pending)


def _stored_version(
    conn: Connection, tables: set[str], *, schema: str, location: str, create: bool
) -> int:
    if not tables:
        if not create:
            raise JournalError(
                f"holds no fsm_runner journal (schema {schema!r} has no tables)", path=location
            )
        return 0
    foreign = JournalError(
        f"schema {schema!r} holds tables that are not an fsm_runner journal "
        f"({', '.join(sorted(tables)[:5])}); nothing was changed",
        path=location,
    )
    if "meta" not in tables:
        raise foreign
    try:
        with conn.transaction():  # a savepoint: a foreign meta table must not abort ours
            meta: dict[Any, Any] = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except psycopg.errors.UndefinedColumn:
        raise foreign from None
    if meta.get("format") != _FORMAT:
        raise foreign
    version = _version(meta, location)
    if version is None:
        raise JournalError("has no schema version", path=location)
    return version


def _version(meta: Mapping[Any, Any], location: str) -> int | None:
    value = meta.get("schema_version")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise JournalError(f"has an unreadable schema version {value!r}", path=location) from None


def integrity_problems(conn: Connection) -> list[str]:
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

    problems = []
    for query, what in checks:
        ids = [str(row[0]) for row in conn.execute(query)]
        if ids:
            problems.append(f"{len(ids)} {what} (first {ids[0]})")
    return problems
