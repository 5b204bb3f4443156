"""A new SQLite journal's schema in one step: the objects every migration leaves, in order.

Written by ``python -m tests.schema_dump`` from a database every migration of
:mod:`._schema` was applied to (do not edit by hand: add a migration, then run it);
``tests/test_new_journal.py`` keeps the two equal. A new journal made here costs a
dozen statements instead of the migrations' hundreds, and opens without importing
sqlite-utils (~0.1 s): every first ``fsm-runner demo``, every test's journal. A journal
that exists is migrated as before.
"""

from __future__ import annotations

import datetime as dt
import sqlite3

__all__ = ["SCHEMA_VERSION", "create"]


#: The schema version these objects are.
SCHEMA_VERSION = 12
#: ``PRAGMA application_id`` (set by the caller).
APPLICATION_ID = 0x46534D52
#: The migrations these objects are the result of, in order.
MIGRATIONS = (
    "m0001_initial",
    "m0002_iterations_artifacts",
    "m0003_return_targets",
    "m0004_effects",
    "m0005_leases",
    "m0006_derived_heads",
    "m0007_run_keys",
    "m0008_abort_fence",
    "m0009_claims_prune_pages",
    "m0010_waits",
    "m0011_digests",
    "m0012_outcomes",
)
#: The ``meta`` rows the migrations write.
META = (
    ("schema_version", "12"),
    ("format", "fsm_runner journal"),
)
#: The schema objects, in the order SQLite holds them.
STATEMENTS = (
    """CREATE TABLE "_sqlite_migrations" (
   "id" INTEGER PRIMARY KEY,
   "migration_set" TEXT,
   "name" TEXT,
   "applied_at" TEXT
)""",
    """CREATE UNIQUE INDEX "idx__sqlite_migrations_migration_set_name"
    ON "_sqlite_migrations" ("migration_set", "name")""",
    """CREATE TABLE "meta" (
   "key" TEXT PRIMARY KEY,
   "value" TEXT
)""",
    """CREATE TABLE "specs" (
   "spec_hash" TEXT PRIMARY KEY,
   "machine" TEXT,
   "json" TEXT,
   "created_at" TEXT
)""",
    """CREATE TABLE "iterations" (
   "run_id" TEXT REFERENCES "run_rows"("run_id"),
   "iteration" INTEGER,
   "state" TEXT,
   "started_at" TEXT,
   "completed_at" TEXT,
   "duration_ms" REAL,
   "snapshot_id" TEXT,
   "feedback" TEXT,
   "feedback_fallback" INTEGER,
   "agent_session_id" TEXT,
   "agent_result_ref" TEXT,
   "agent_duration_ms" REAL,
   "success" INTEGER,
   "model" TEXT,
   "tokens_input" INTEGER,
   "tokens_output" INTEGER,
   "tokens_total" INTEGER,
   "cost_usd" REAL,
   "verification_ref" TEXT,
   "passed" INTEGER,
   "levels_run" TEXT,
   "verification_duration_ms" REAL,
   "error_type" TEXT,
   "error_message" TEXT,
   "error_details" TEXT,
   "extra" TEXT, digest TEXT,
   PRIMARY KEY ("run_id", "iteration")
)""",
    """CREATE TABLE "artifacts" (
   "id" INTEGER PRIMARY KEY,
   "run_id" TEXT NOT NULL REFERENCES "run_rows"("run_id"),
   "name" TEXT NOT NULL,
   "kind" TEXT,
   "seq" INTEGER,
   "iteration" INTEGER,
   "status" TEXT,
   "path" TEXT,
   "sha256" TEXT,
   "size" INTEGER,
   "error" TEXT,
   "content" TEXT,
   "created_at" TEXT
, digest TEXT)""",
    """CREATE UNIQUE INDEX "idx_artifacts_run_id_name"
    ON "artifacts" ("run_id", "name")""",
    """CREATE TABLE "effects" (
   "run_id" TEXT REFERENCES "run_rows"("run_id"),
   "visit_seq" INTEGER,
   "name" TEXT,
   "state" TEXT,
   "kind" TEXT,
   "params" TEXT,
   "idempotency_key" TEXT,
   "status" TEXT,
   "result" TEXT,
   "error" TEXT,
   "idempotent" INTEGER,
   "started_at" TEXT,
   "completed_at" TEXT, digest TEXT,
   PRIMARY KEY ("run_id", "visit_seq", "name")
)""",
    """CREATE INDEX "idx_effects_status"
    ON "effects" ("status")""",
    """CREATE TABLE "transitions" (
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
   run_key INTEGER NOT NULL, digest TEXT,
   PRIMARY KEY (run_key, seq)
)""",
    """CREATE TABLE "run_rows" (
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
, wake_at TEXT, digest TEXT)""",
    """CREATE INDEX idx_run_rows_machine ON run_rows (machine)""",
    """CREATE INDEX idx_run_rows_status ON run_rows (status) WHERE status != 'active'""",
    """CREATE INDEX idx_run_rows_parent ON run_rows (parent_run_id) WHERE parent_run_id IS NOT NULL""",
    """CREATE INDEX idx_run_rows_leased ON run_rows (machine, lease_expires_at) WHERE status = 'active' AND lease_owner IS NOT NULL""",
    """CREATE INDEX idx_run_rows_ended ON run_rows (updated_at) WHERE status != 'active'""",
    """CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
BEGIN
    SELECT RAISE(ABORT, 'fsm_runner: a transition needs the run_key of its run (SELECT run_key FROM run_rows WHERE run_id = ...)') WHERE NEW.run_key IS NULL;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE NOT EXISTS (SELECT 1 FROM run_rows
                        WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                          AND lease_token = NEW.lease_token
                          AND (abort_token IS NULL OR abort_token < NEW.lease_token
                               OR NEW.event = 'USER_ABORTED'))
        OR NOT EXISTS (SELECT 1 FROM transitions
                        WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
END""",
    """CREATE TRIGGER run_rows_released AFTER UPDATE OF lease_owner ON run_rows
 WHEN NEW.lease_owner IS NULL AND OLD.lease_owner IS NOT NULL AND NEW.status = 'active'
BEGIN
    UPDATE run_rows SET (state, seq, iteration, updated_at, visit_seq) =
           (SELECT t.to_state, t.seq, t.iteration, t.at, t.seq FROM transitions AS t
             WHERE t.run_key = NEW.run_key ORDER BY t.seq DESC LIMIT 1)
     WHERE run_key = NEW.run_key
       AND seq < (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = NEW.run_key);
END""",
    """CREATE VIEW runs AS
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
   AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_key = r.run_key)""",
    """CREATE TABLE signals (
   number INTEGER PRIMARY KEY,
   run_key INTEGER NOT NULL REFERENCES run_rows(run_key),
   run_id TEXT NOT NULL,
   name TEXT NOT NULL,
   payload TEXT,
   signal_id TEXT,
   received_at TEXT NOT NULL,
   consumed_seq INTEGER,
   consumed_at TEXT
, digest TEXT)""",
    """CREATE INDEX idx_run_rows_ready ON run_rows (machine, state) WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NULL""",
    """CREATE INDEX idx_run_rows_due ON run_rows (machine, wake_at) WHERE status = 'active' AND lease_owner IS NULL AND wake_at IS NOT NULL""",
    """CREATE INDEX idx_signals_run ON signals (run_key, number)""",
    """CREATE UNIQUE INDEX idx_signals_id ON signals (run_key, signal_id) WHERE signal_id IS NOT NULL""",
    """CREATE INDEX idx_run_rows_outcomes ON run_rows (machine, state, status) WHERE status != 'active'""",
)


def create(conn: sqlite3.Connection) -> None:
    """Make the schema on ``conn``, an empty database, inside the caller's transaction."""
    for statement in STATEMENTS:
        conn.execute(statement)
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", META)
    applied = str(dt.datetime.now(dt.timezone.utc))
    conn.executemany(
        "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) VALUES (?, ?, ?)",
        [("fsm_runner", name, applied) for name in MIGRATIONS],
    )
