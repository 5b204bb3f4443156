"""The SQLite journal's schema: its migrations, applied with sqlite-utils.

Imported only when a journal is created or migrated, so that opening an up-to-date journal
(every command, every worker) does not import sqlite-utils. Migrations are frozen once released:
a change of schema is a new migration, never an edit of an old one.
"""

from __future__ import annotations

import sqlite3

import sqlite_utils
from sqlite_utils.migrations import Migrations

from fsm_runner.events import USER_ABORTED
from fsm_runner.journal._schema_v11 import m0011_digests
from fsm_runner.journal._sqlite_chain import fill_signal_digests
from fsm_runner.journal._sqlite_errors import NO_RUN_KEY, STALE_SEQ

__all__ = ["database", "migrate", "unknown_migrations"]

_migrations = Migrations("fsm_runner")


def database(conn: sqlite3.Connection) -> sqlite_utils.Database:
    """sqlite-utils' view of the journal's connection (recursive triggers stay off)."""
    return sqlite_utils.Database(conn, execute_plugins=False, recursive_triggers=False)


def migrate(db: sqlite_utils.Database) -> None:
    """Apply every migration the journal lacks, in order."""
    _migrations.apply(db)


def unknown_migrations(db: sqlite_utils.Database) -> set[str]:
    """Migrations the journal has that this fsm_runner does not know (a newer one wrote it)."""
    return {m.name for m in _migrations.applied(db)} - set(_MIGRATION_VERSIONS)


@_migrations()
def m0001_initial(db: sqlite_utils.Database) -> None:
    """Create the version-1 schema: meta, specs, runs and transitions."""
    db["meta"].create({"key": str, "value": str}, pk="key")  # type: ignore[union-attr]
    db["specs"].create(  # type: ignore[union-attr]
        {"spec_hash": str, "machine": str, "json": str, "created_at": str}, pk="spec_hash"
    )
    db["runs"].create(  # type: ignore[union-attr]
        {
            "run_id": str,
            "machine": str,
            "spec_hash": str,
            "state": str,
            "status": str,
            "seq": int,
            "iteration": int,
            "attempt": int,
            "input": str,
            "context": str,
            "error": str,
            "created_at": str,
            "updated_at": str,
            "parent_run_id": str,
            "forked_from": str,
            "abort_reason": str,
            "lease_owner": str,
            "lease_expires_at": str,
            "lease_token": int,
        },
        pk="run_id",
        not_null={"machine", "spec_hash", "state", "status", "seq", "created_at"},
        defaults={"lease_token": 0, "iteration": 0, "attempt": 1},
        foreign_keys=[("spec_hash", "specs", "spec_hash")],
    )
    db["runs"].create_index(["machine", "created_at"])  # type: ignore[union-attr]
    db["runs"].create_index(["status", "created_at"])  # type: ignore[union-attr]
    db["runs"].create_index(["created_at"])  # type: ignore[union-attr]
    db["runs"].create_index(["parent_run_id"])  # type: ignore[union-attr]
    db["transitions"].create(  # type: ignore[union-attr]
        {
            "run_id": str,
            "seq": int,
            "from_state": str,
            "event": str,
            "to_state": str,
            "iteration": int,
            "attempt": int,
            "at": str,
            "duration_ms": float,
            "result": str,
        },
        pk=("run_id", "seq"),
        not_null={"event", "to_state", "at"},
        foreign_keys=[("run_id", "runs", "run_id")],
    )
    # The run row is a projection of its last transition, kept by the database itself: the
    # INSERT of transition N moves the run row from seq N-1 to N, or fails as a whole.
    db.execute(
        f"""
        CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                            updated_at = NEW.at
             WHERE run_id = NEW.run_id AND seq = NEW.seq - 1;
            SELECT RAISE(ABORT, '{STALE_SEQ}') WHERE changes() = 0;
        END
        """
    )
    db["meta"].insert_all(  # type: ignore[union-attr]
        [
            {"key": "schema_version", "value": "1"},
            {"key": "format", "value": "fsm_runner journal"},
        ],
        replace=True,
    )


@_migrations()
def m0002_iterations_artifacts(db: sqlite_utils.Database) -> None:
    """Version 2: per-iteration records and artifacts."""
    db["iterations"].create(  # type: ignore[union-attr]
        {
            "run_id": str,
            "iteration": int,
            "state": str,
            "started_at": str,
            "completed_at": str,
            "duration_ms": float,
            "snapshot_id": str,
            "feedback": str,
            "feedback_fallback": int,
            "agent_session_id": str,
            "agent_result_ref": str,
            "agent_duration_ms": float,
            "success": int,
            "model": str,
            "tokens_input": int,
            "tokens_output": int,
            "tokens_total": int,
            "cost_usd": float,
            "verification_ref": str,
            "passed": int,
            "levels_run": str,
            "verification_duration_ms": float,
            "error_type": str,
            "error_message": str,
            "error_details": str,
            "extra": str,
        },
        pk=("run_id", "iteration"),
        foreign_keys=[("run_id", "runs", "run_id")],
    )
    db["artifacts"].create(  # type: ignore[union-attr]
        {
            "id": int,
            "run_id": str,
            "name": str,
            "kind": str,
            "seq": int,
            "iteration": int,
            "status": str,
            "path": str,
            "sha256": str,
            "size": int,
            "error": str,
            "content": str,
            "created_at": str,
        },
        pk="id",
        not_null={"run_id", "name"},
        foreign_keys=[("run_id", "runs", "run_id")],
    )
    db["artifacts"].create_index(["run_id", "name"], unique=True)  # type: ignore[union-attr]
    db.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


@_migrations()
def m0003_return_targets(db: sqlite_utils.Database) -> None:
    """Version 3: where a history (RETURN) transition takes a run."""
    db["runs"].add_column("return_to", str)  # type: ignore[union-attr]
    db["runs"].add_column("return_attempt", int, not_null_default=0)  # type: ignore[union-attr]
    db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


@_migrations()
def m0004_effects(db: sqlite_utils.Database) -> None:
    """Version 4: the effects ledger, and the visit each run is on."""
    runs = db["runs"]
    runs.add_column("visit_seq", int, not_null_default=0)  # type: ignore[union-attr]
    runs.add_column("return_visit", int, not_null_default=0)  # type: ignore[union-attr]
    db.execute("UPDATE runs SET visit_seq = seq")  # older runs: each on the visit it is in
    # The trigger now also moves visit_seq: a transition begins a new visit unless it is a
    # retry or an interruption of the phase (the engine's own update corrects a RETURN).
    db.execute("DROP TRIGGER IF EXISTS transitions_advance_run")
    db.execute(
        f"""
        CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                            updated_at = NEW.at,
                            visit_seq = CASE WHEN NEW.from_state IS NEW.to_state
                                               AND NEW.event IN ('RETRIED', 'INTERRUPTED')
                                             THEN visit_seq ELSE NEW.seq END
             WHERE run_id = NEW.run_id AND seq = NEW.seq - 1;
            SELECT RAISE(ABORT, '{STALE_SEQ}') WHERE changes() = 0;
        END
        """
    )
    db["effects"].create(  # type: ignore[union-attr]
        {
            "run_id": str,
            "visit_seq": int,
            "name": str,
            "state": str,
            "kind": str,
            "params": str,
            "idempotency_key": str,
            "status": str,
            "result": str,
            "error": str,
            "idempotent": int,
            "started_at": str,
            "completed_at": str,
        },
        pk=("run_id", "visit_seq", "name"),
        foreign_keys=[("run_id", "runs", "run_id")],
    )
    db["effects"].create_index(["status"])  # type: ignore[union-attr]
    db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")


@_migrations()
def m0005_leases(db: sqlite_utils.Database) -> None:
    """Version 5: fencing tokens on transitions, and recovery counts on runs."""
    db["transitions"].add_column("lease_token", int, not_null_default=0)  # type: ignore[union-attr]
    db["runs"].add_column("recoveries", int, not_null_default=0)  # type: ignore[union-attr]
    # The trigger now also fences: transition N is refused unless it carries the run's current
    # lease token, so a worker whose lease was taken over cannot write.
    db.execute("DROP TRIGGER IF EXISTS transitions_advance_run")
    db.execute(
        f"""
        CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                            updated_at = NEW.at,
                            visit_seq = CASE WHEN NEW.from_state IS NEW.to_state
                                               AND NEW.event IN ('RETRIED', 'INTERRUPTED')
                                             THEN visit_seq ELSE NEW.seq END
             WHERE run_id = NEW.run_id AND seq = NEW.seq - 1 AND lease_token = NEW.lease_token;
            SELECT RAISE(ABORT, '{STALE_SEQ}') WHERE changes() = 0;
        END
        """
    )
    db["runs"].create_index(["status", "lease_expires_at"])  # type: ignore[union-attr]
    # claim_next picks the oldest active run of a machine inside the write lock: this index
    # makes that a range scan instead of a sort of every active run (~0.8 ms at 1,000). Not on
    # updated_at: every step writes that, and an index on it costs every step ~10 µs.
    db["runs"].create_index(["status", "machine", "created_at"])  # type: ignore[union-attr]
    db.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")


@_migrations()
def m0006_derived_heads(db: sqlite_utils.Database) -> None:
    """Version 6: a run's head (state, seq, iteration, ...) is its last transition.

    Until version 5 a trigger copied every transition into the run row, so each step wrote two
    rows (its transition and the run's), and SQLite a second page: ~10 µs of a ~35 µs commit.
    Now the run's stored row (``run_rows``) is written only when something besides the head
    changes, and the ``runs`` view reads the head from the last transition. A BEFORE trigger
    keeps both guarantees the old one gave: transition N is stored only on top of N - 1 (the
    primary key refuses a second N) and only with the run's current lease token.
    """
    db.execute("DROP TRIGGER IF EXISTS transitions_advance_run")
    db.execute("ALTER TABLE runs RENAME TO run_rows")  # references in other tables follow
    db.execute(
        f"""
        CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            SELECT RAISE(ABORT, '{STALE_SEQ}')
             WHERE NOT EXISTS (SELECT 1 FROM run_rows
                                WHERE run_id = NEW.run_id AND lease_token = NEW.lease_token)
                OR NOT EXISTS (SELECT 1 FROM transitions
                                WHERE run_id = NEW.run_id AND seq = NEW.seq - 1);
        END
        """
    )
    # The head is the stored row's unless transitions went past it: then the last transition
    # gives state, seq and iteration, and, as the steps since were plain ones (each starting a
    # new visit at its own seq), updated_at and visit_seq too. row_order: the order runs were
    # stored in (a view has no rowid of its own). A LEFT JOIN: a run whose transitions are gone
    # (a journal edited by hand) still shows, for check and replay to report.
    db.execute(
        """
        CREATE VIEW runs AS
        SELECT r.run_id, r.machine, r.spec_hash,
               CASE WHEN t.seq > r.seq THEN t.to_state ELSE r.state END AS state,
               r.status,
               CASE WHEN t.seq > r.seq THEN t.seq ELSE r.seq END AS seq,
               CASE WHEN t.seq > r.seq THEN t.iteration ELSE r.iteration END AS iteration,
               r.attempt, r.input, r.context, r.error, r.created_at,
               CASE WHEN t.seq > r.seq THEN t.at ELSE r.updated_at END AS updated_at,
               r.parent_run_id, r.forked_from, r.abort_reason, r.lease_owner,
               r.lease_expires_at, r.lease_token, r.return_to, r.return_attempt,
               CASE WHEN t.seq > r.seq THEN t.seq ELSE r.visit_seq END AS visit_seq,
               r.return_visit, r.recoveries, r.rowid AS row_order
          FROM run_rows AS r
          LEFT JOIN transitions AS t
            ON t.run_id = r.run_id
           AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_id = r.run_id)
        """
    )
    db.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


_RUN_ROWS_V7 = """
CREATE TABLE run_rows_v7 (
   run_key INTEGER PRIMARY KEY AUTOINCREMENT,
   run_id TEXT NOT NULL UNIQUE,
   machine TEXT NOT NULL,
   spec_hash TEXT NOT NULL REFERENCES specs(spec_hash),
   state TEXT NOT NULL,
   status TEXT NOT NULL,
   seq INTEGER NOT NULL,
   iteration INTEGER DEFAULT 0,
   attempt INTEGER DEFAULT 1,
   input TEXT,
   context TEXT,
   error TEXT,
   created_at TEXT NOT NULL,
   updated_at TEXT,
   parent_run_id TEXT,
   forked_from TEXT,
   abort_reason TEXT,
   lease_owner TEXT,
   lease_expires_at TEXT,
   lease_token INTEGER DEFAULT 0,
   return_to TEXT,
   return_attempt INTEGER NOT NULL DEFAULT 0,
   visit_seq INTEGER NOT NULL DEFAULT 0,
   return_visit INTEGER NOT NULL DEFAULT 0,
   recoveries INTEGER NOT NULL DEFAULT 0
)
"""
_TRANSITIONS_V7 = """
CREATE TABLE transitions_v7 (
   run_id TEXT REFERENCES run_rows(run_id),
   seq INTEGER NOT NULL,
   from_state TEXT,
   event TEXT NOT NULL,
   to_state TEXT NOT NULL,
   iteration INTEGER,
   attempt INTEGER,
   at TEXT NOT NULL,
   duration_ms REAL,
   result TEXT,
   lease_token INTEGER NOT NULL DEFAULT 0,
   run_key INTEGER NOT NULL,
   PRIMARY KEY (run_key, seq)
)
"""
_RUN_ROW_COLUMNS_V6 = (
    "run_id, machine, spec_hash, state, status, seq, iteration, attempt, input, context, error,"
    " created_at, updated_at, parent_run_id, forked_from, abort_reason, lease_owner,"
    " lease_expires_at, lease_token, return_to, return_attempt, visit_seq, return_visit,"
    " recoveries"
)
_TRANSITION_COLUMNS_V6 = (
    "run_id, seq, from_state, event, to_state, iteration, attempt, at, duration_ms, result,"
    " lease_token"
)


@_migrations()
def m0007_run_keys(db: sqlite_utils.Database) -> None:
    """Version 7: transitions are keyed by an integer run key, ``(run_key, seq)``.

    Until version 6 their primary key was ``(run_id, seq)``, 32 characters of run id in every
    index entry: ~90 entries a page, so a group commit of a thousand runs (each appending to
    its own part of the index) wrote about a page a run, and each insert compared long keys.
    ``run_rows`` gets ``run_key INTEGER PRIMARY KEY AUTOINCREMENT`` (stable across VACUUM,
    never reused), ``run_id`` stays ``UNIQUE`` for every lookup by id; ``transitions`` keeps
    ``run_id`` for readers and gains ``run_key``, which the fence trigger checks against the
    run's id. Both tables are rebuilt, in their rowid order; transitions whose run is gone (a
    journal edited by hand) keep a negative key, so ``check`` still reports them.
    """
    db.execute("DROP VIEW IF EXISTS runs")
    db.execute("DROP TRIGGER IF EXISTS transitions_fence")
    indexes = [
        str(row[0])
        for row in db.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'run_rows'"
            " AND sql IS NOT NULL"
        ).fetchall()
    ]
    db.execute(_RUN_ROWS_V7)
    db.execute(
        f"INSERT INTO run_rows_v7 (run_key, {_RUN_ROW_COLUMNS_V6})"
        f" SELECT rowid, {_RUN_ROW_COLUMNS_V6} FROM run_rows ORDER BY rowid"
    )
    db.execute(_TRANSITIONS_V7)
    db.execute(
        f"INSERT INTO transitions_v7 ({_TRANSITION_COLUMNS_V6}, run_key)"
        f" SELECT {', '.join('t.' + c.strip() for c in _TRANSITION_COLUMNS_V6.split(','))},"
        "        coalesce(r.run_key, -(SELECT min(o.rowid) FROM transitions AS o"
        "                               WHERE o.run_id IS t.run_id))"
        "   FROM transitions AS t LEFT JOIN run_rows_v7 AS r ON r.run_id = t.run_id"
        "  ORDER BY t.rowid"
    )
    db.execute("DROP TABLE transitions")
    db.execute("DROP TABLE run_rows")
    db.execute("ALTER TABLE run_rows_v7 RENAME TO run_rows")
    db.execute("ALTER TABLE transitions_v7 RENAME TO transitions")
    for sql in indexes:
        db.execute(sql)
    db.execute(
        f"""
        CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            SELECT RAISE(ABORT, '{NO_RUN_KEY}') WHERE NEW.run_key IS NULL;
            SELECT RAISE(ABORT, '{STALE_SEQ}')
             WHERE NOT EXISTS (SELECT 1 FROM run_rows
                                WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                                  AND lease_token = NEW.lease_token)
                OR NOT EXISTS (SELECT 1 FROM transitions
                                WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
        END
        """
    )
    db.execute(
        """
        CREATE VIEW runs AS
        SELECT r.run_id, r.machine, r.spec_hash,
               CASE WHEN t.seq > r.seq THEN t.to_state ELSE r.state END AS state,
               r.status,
               CASE WHEN t.seq > r.seq THEN t.seq ELSE r.seq END AS seq,
               CASE WHEN t.seq > r.seq THEN t.iteration ELSE r.iteration END AS iteration,
               r.attempt, r.input, r.context, r.error, r.created_at,
               CASE WHEN t.seq > r.seq THEN t.at ELSE r.updated_at END AS updated_at,
               r.parent_run_id, r.forked_from, r.abort_reason, r.lease_owner,
               r.lease_expires_at, r.lease_token, r.return_to, r.return_attempt,
               CASE WHEN t.seq > r.seq THEN t.seq ELSE r.visit_seq END AS visit_seq,
               r.return_visit, r.recoveries, r.run_key
          FROM run_rows AS r
          LEFT JOIN transitions AS t
            ON t.run_key = r.run_key
           AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = r.run_key)
        """
    )
    db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")


@_migrations()
def m0008_abort_fence(db: sqlite_utils.Database) -> None:
    """Version 8: a holder that has not seen an abort request can journal only the abort.

    Until version 7 a holder that had not yet seen a request (it landed while the holder's
    phase ran) committed the phase's outcome over it, and could finish the run ``succeeded``
    after the operator was told the abort was requested. ``run_rows.abort_token`` now keeps the
    lease token that was the run's when the abort was requested, and the fence refuses every
    transition but ``USER_ABORTED`` written under that token or an older one — in the statement
    that checks the seq and the token already, on the run row it reads anyway — so the holder
    learns of the request at its next commit. A writer that claims the run afterwards has read
    the request (the engine then carries it out first; an operator may still ``send``).
    """
    db.execute("ALTER TABLE run_rows ADD COLUMN abort_token INTEGER")
    db.execute(
        "UPDATE run_rows SET abort_token = lease_token"
        " WHERE abort_reason IS NOT NULL AND status = 'active'"
    )
    db.execute("DROP TRIGGER IF EXISTS transitions_fence")
    db.execute(
        f"""
        CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
        BEGIN
            SELECT RAISE(ABORT, '{NO_RUN_KEY}') WHERE NEW.run_key IS NULL;
            SELECT RAISE(ABORT, '{STALE_SEQ}')
             WHERE NOT EXISTS (SELECT 1 FROM run_rows
                                WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                                  AND lease_token = NEW.lease_token
                                  AND (abort_token IS NULL OR abort_token < NEW.lease_token
                                       OR NEW.event = '{USER_ABORTED}'))
                OR NOT EXISTS (SELECT 1 FROM transitions
                                WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
        END
        """
    )
    db.execute("UPDATE meta SET value = '8' WHERE key = 'schema_version'")


_RUN_ROWS_V9 = """
CREATE TABLE run_rows_v9 (
   run_key INTEGER PRIMARY KEY,
   run_id TEXT NOT NULL UNIQUE,
   machine TEXT NOT NULL,
   spec_hash TEXT NOT NULL REFERENCES specs(spec_hash),
   state TEXT NOT NULL,
   status TEXT NOT NULL,
   seq INTEGER NOT NULL,
   iteration INTEGER DEFAULT 0,
   attempt INTEGER DEFAULT 1,
   input TEXT,
   context TEXT,
   error TEXT,
   created_at TEXT NOT NULL,
   updated_at TEXT,
   parent_run_id TEXT,
   forked_from TEXT,
   abort_reason TEXT,
   lease_owner TEXT,
   lease_expires_at TEXT,
   lease_token INTEGER DEFAULT 0,
   return_to TEXT,
   return_attempt INTEGER NOT NULL DEFAULT 0,
   visit_seq INTEGER NOT NULL DEFAULT 0,
   return_visit INTEGER NOT NULL DEFAULT 0,
   recoveries INTEGER NOT NULL DEFAULT 0,
   abort_token INTEGER
)
"""
_INDEXES_V9 = (
    # Listing: newest first by key, all runs, by machine, by how they ended (an index's entries
    # are ordered by the rowid after their columns, so none names run_key). The active runs are
    # listed from the claims' two indexes (see SqliteJournal's dialect): an index of them by
    # status would cost every run two more pages, going in at its start and out at its end.
    "CREATE INDEX idx_run_rows_machine ON run_rows (machine)",
    "CREATE INDEX idx_run_rows_status ON run_rows (status) WHERE status != 'active'",
    "CREATE INDEX idx_run_rows_parent ON run_rows (parent_run_id) WHERE parent_run_id IS NOT NULL",
    # Claims: the unleased active runs by their stored state (the head: see the fence and the
    # release trigger), the leased ones by expiry.
    "CREATE INDEX idx_run_rows_ready ON run_rows (machine, state)"
    " WHERE status = 'active' AND lease_owner IS NULL",
    "CREATE INDEX idx_run_rows_leased ON run_rows (machine, lease_expires_at)"
    " WHERE status = 'active' AND lease_owner IS NOT NULL",
    # Prune (and check --since): an ended run's row holds its last update.
    "CREATE INDEX idx_run_rows_ended ON run_rows (updated_at) WHERE status != 'active'",
)
#: The fence of version 8, unchanged (the tables it names are rebuilt).
_FENCE_V9 = f"""
CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
BEGIN
    SELECT RAISE(ABORT, '{NO_RUN_KEY}') WHERE NEW.run_key IS NULL;
    SELECT RAISE(ABORT, '{STALE_SEQ}')
     WHERE NOT EXISTS (SELECT 1 FROM run_rows
                        WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                          AND lease_token = NEW.lease_token
                          AND (abort_token IS NULL OR abort_token < NEW.lease_token
                               OR NEW.event = '{USER_ABORTED}'))
        OR NOT EXISTS (SELECT 1 FROM transitions
                        WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
END
"""
#: A run let go of while active: its row becomes its head, as the claims of unleased runs read
#: it (a run that ends is written whole by its last commit).
_RELEASED_V9 = """
CREATE TRIGGER run_rows_released AFTER UPDATE OF lease_owner ON run_rows
 WHEN NEW.lease_owner IS NULL AND OLD.lease_owner IS NOT NULL AND NEW.status = 'active'
BEGIN
    UPDATE run_rows SET (state, seq, iteration, updated_at, visit_seq) =
           (SELECT t.to_state, t.seq, t.iteration, t.at, t.seq FROM transitions AS t
             WHERE t.run_key = NEW.run_key ORDER BY t.seq DESC LIMIT 1)
     WHERE run_key = NEW.run_key
       AND seq < (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = NEW.run_key);
END
"""
_VIEW_V9 = """
CREATE VIEW runs AS
SELECT r.run_id, r.machine, r.spec_hash,
       CASE WHEN t.seq > r.seq THEN t.to_state ELSE r.state END AS state,
       r.status,
       CASE WHEN t.seq > r.seq THEN t.seq ELSE r.seq END AS seq,
       CASE WHEN t.seq > r.seq THEN t.iteration ELSE r.iteration END AS iteration,
       r.attempt, r.input, r.context, r.error, r.created_at,
       CASE WHEN t.seq > r.seq THEN t.at ELSE r.updated_at END AS updated_at,
       r.parent_run_id, r.forked_from, r.abort_reason, r.lease_owner,
       r.lease_expires_at, r.lease_token, r.return_to, r.return_attempt,
       CASE WHEN t.seq > r.seq THEN t.seq ELSE r.visit_seq END AS visit_seq,
       r.return_visit, r.recoveries, r.run_key
  FROM run_rows AS r
  LEFT JOIN transitions AS t
    ON t.run_key = r.run_key
   AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = r.run_key)
"""
_RUN_ROW_COLUMNS_V8 = _RUN_ROW_COLUMNS_V6 + ", abort_token"


@_migrations()
def m0009_claims_prune_pages(db: sqlite_utils.Database) -> None:
    """Version 9: claims and prune from index ranges, and fewer pages written a run.

    * An unleased active run's stored row is its head: a commit of a run nobody holds writes
      its row with the transition (the writer: a trigger's UPDATE cost every held step ~9,000
      instructions, 10 %), and ``run_rows_released`` moves it to the head at each release.
      So the runs a claim may take are one range of ``idx_run_rows_ready`` per state (the
      leased ones whose lease expired, one of ``idx_run_rows_leased``), with no per-run
      ``max(seq)`` under a scan of every active run.
    * An ended run's row is written when it ends, its ``updated_at`` with it: prune reads one
      range of ``idx_run_rows_ended``.
    * Pages: ``run_rows`` loses ``AUTOINCREMENT`` and its ``sqlite_sequence`` page a start: a
      new key is still above every stored one (listing stays newest first), and a key is only
      ever compared along with its run id. Its six indexes become the six above: listing in key
      order (the order runs were stored in) instead of by ``created_at``; the parent's, the
      claims', prune's and the ended runs' by status partial. ``transitions`` stays a rowid
      table with its ``(run_key, seq)`` key: as ``WITHOUT ROWID`` (rows clustered by run) a
      short run wrote 3 pages fewer, but a group commit of 1,000 runs wrote to ~1,000 leaves
      instead of the table's last pages and a small index's, and went 35 % slower (and SQLite
      3.40's ``integrity_check`` misreads the NOT NULL columns of a WITHOUT ROWID table whose
      key columns are not its first).
    """
    db.execute("DROP VIEW IF EXISTS runs")
    db.execute("DROP TRIGGER IF EXISTS transitions_fence")
    db.execute(_RUN_ROWS_V9)
    db.execute(
        f"INSERT INTO run_rows_v9 (run_key, {_RUN_ROW_COLUMNS_V8})"
        f" SELECT run_key, {_RUN_ROW_COLUMNS_V8} FROM run_rows ORDER BY run_key"
    )
    db.execute("DROP TABLE run_rows")
    db.execute("ALTER TABLE run_rows_v9 RENAME TO run_rows")
    db.execute("DELETE FROM sqlite_sequence WHERE name IN ('run_rows', 'run_rows_v9')")
    # Every run's row brought to its head: what the runs view derived is now stored.
    db.execute(
        "UPDATE run_rows SET (state, seq, iteration, updated_at, visit_seq) ="
        " (SELECT t.to_state, t.seq, t.iteration, t.at, t.seq FROM transitions AS t"
        "   WHERE t.run_key = run_rows.run_key ORDER BY t.seq DESC LIMIT 1)"
        " WHERE seq < (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = run_rows.run_key)"
    )
    for sql in _INDEXES_V9:
        db.execute(sql)
    db.execute(_FENCE_V9)
    db.execute(_RELEASED_V9)
    db.execute(_VIEW_V9)
    db.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")


#: The signals sent to runs (schema version 10): a run's mailbox, kept after consumption.
#: ``number`` is the arrival order (a new one is above every stored one); ``payload`` JSON
#: text; a signal is consumed when ``consumed_seq`` is set, else pending (expired once its run
#: has ended: derived, never stored).
_SIGNALS_V10 = """
CREATE TABLE signals (
   number INTEGER PRIMARY KEY,
   run_key INTEGER NOT NULL REFERENCES run_rows(run_key),
   run_id TEXT NOT NULL,
   name TEXT NOT NULL,
   payload TEXT,
   signal_id TEXT,
   received_at TEXT NOT NULL,
   consumed_seq INTEGER,
   consumed_at TEXT
)
"""
_INDEXES_V10 = (
    # Claims: the unleased active runs with no wake time, by state (a run its phase parked,
    # with a wake time to come, is not runnable before it: it is read from the next index).
    "CREATE INDEX idx_run_rows_ready ON run_rows (machine, state)"
    " WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NULL",
    # Claims and next_wake: the unleased active runs that have a wake time, by it.
    "CREATE INDEX idx_run_rows_due ON run_rows (machine, wake_at)"
    " WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL",
    # A run's signals in arrival order; its signal ids, each once.
    "CREATE INDEX idx_signals_run ON signals (run_key, number)",
    "CREATE UNIQUE INDEX idx_signals_id ON signals (run_key, signal_id)"
    " WHERE signal_id IS NOT NULL",
)


@_migrations()
def m0010_waits(db: sqlite_utils.Database) -> None:
    """Version 10: durable waits: a run's wake time, and the signals sent to runs.

    * ``run_rows.wake_at``: when ``claim_next`` offers the run whatever its state (set by a
      park and by a signal's arrival, dropped by a release if still to come and when the run
      ends), read by
      claims and ``next_wake`` from one range of ``idx_run_rows_due``; ``idx_run_rows_ready``
      is remade partial to the runs with none (a run its phase parked is not runnable before
      its wake time). A column added: the ``runs`` view
      names its columns, and neither it nor the triggers change.
    * ``signals``: each signal sent to a run, numbered in arrival order, pending until a
      transition of the run consumes it (``consumed_seq``, ``consumed_at``).
    """
    db.execute("ALTER TABLE run_rows ADD COLUMN wake_at TEXT")
    db.execute("DROP INDEX idx_run_rows_ready")
    db.execute(_SIGNALS_V10)
    for sql in _INDEXES_V10:
        db.execute(sql)
    db.execute("UPDATE meta SET value = '10' WHERE key = 'schema_version'")


_migrations()(m0011_digests)  # version 11: a module of its own (this one's size)

#: The ended runs by machine, state and status (schema version 12).
_OUTCOMES_V12 = (
    "CREATE INDEX idx_run_rows_outcomes ON run_rows (machine, state, status)"
    " WHERE status != 'active'"
)


@_migrations()
def m0012_outcomes(db: sqlite_utils.Database) -> None:
    """Version 12: counts by state from indexes (issue 32), and each signal's digest (issue 30).

    * ``idx_run_rows_outcomes``: the ended runs by machine, state and status, partial to them
      (an ended run's row no longer changes: the entry is written once, when the run ends,
      and never by a step). A machine's counts per state and status are then ranges of it
      and of the claims' indexes (the active runs nobody holds: their rows are their heads),
      with the leased runs alone read through the ``runs`` view; a listing by state reads the
      same indexes (the ended runs' covering) instead of every run through the view.
    * ``signals.digest``: a digest of what the signal's sender wrote
      (:data:`~._digest.SIGNAL_DIGEST_COLUMNS`), written with it; the signals the journal
      holds get theirs computed here, from what they hold then.
    """
    db.execute(_OUTCOMES_V12)
    db.execute("ALTER TABLE signals ADD COLUMN digest TEXT")
    fill_signal_digests(db.conn)
    db.execute("UPDATE meta SET value = '12' WHERE key = 'schema_version'")


_MIGRATION_VERSIONS = {
    "m0001_initial": 1,
    "m0002_iterations_artifacts": 2,
    "m0003_return_targets": 3,
    "m0004_effects": 4,
    "m0005_leases": 5,
    "m0006_derived_heads": 6,
    "m0007_run_keys": 7,
    "m0008_abort_fence": 8,
    "m0009_claims_prune_pages": 9,
    "m0010_waits": 10,
    "m0011_digests": 11,
    "m0012_outcomes": 12,
}
