"""The SQLite journal's schema: its migrations, applied with sqlite-utils.

Imported only when a journal is created or migrated, so that opening an up-to-date journal
(every command, every worker) does not import sqlite-utils. Migrations are frozen once released:
a change of schema is a new migration, never an edit of an old one.
"""

from __future__ import annotations

import sqlite3

import sqlite_utils
from sqlite_utils.migrations import Migrations

from fsm_runner.journal.sqlite import _STALE_SEQ

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
            SELECT RAISE(ABORT, '{_STALE_SEQ}') WHERE changes() = 0;
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
            SELECT RAISE(ABORT, '{_STALE_SEQ}') WHERE changes() = 0;
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
            SELECT RAISE(ABORT, '{_STALE_SEQ}') WHERE changes() = 0;
        END
        """
    )
    db["runs"].create_index(["status", "lease_expires_at"])  # type: ignore[union-attr]
    # claim_next picks the oldest active run of a machine inside the write lock: this index
    # makes that a range scan instead of a sort of every active run (~0.8 ms at 1,000). Not on
    # updated_at: every step writes that, and an index on it costs every step ~10 µs.
    db["runs"].create_index(["status", "machine", "created_at"])  # type: ignore[union-attr]
    db.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")


_MIGRATION_VERSIONS = {
    "m0001_initial": 1,
    "m0002_iterations_artifacts": 2,
    "m0003_return_targets": 3,
    "m0004_effects": 4,
    "m0005_leases": 5,
}
