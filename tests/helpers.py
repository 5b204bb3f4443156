"""Small machines and handlers shared by the tests."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import attrs

from fsm_runner import RETURN, Engine, MachineSpec, PhaseStatus, RunEvent, State, Transition
from fsm_runner.journal._sqlite_chain import fill_digests

NEXT = "NEXT"
PHASE_COMPLETED = RunEvent.PHASE_COMPLETED.value
SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
LOST = "SERVER_LOST"
FOUND = "SERVER_FOUND"


def snapshot(journal, run_id: str):
    """The run row and every transition: what "nothing changed" compares.

    A refused step has still taken and given back the run's lease: the lease token (the
    bookkeeping of who may write) is left out, and the lease must be free again.
    """
    run = journal.load(run_id)
    assert run.lease_owner is None, f"run {run_id} is still leased to {run.lease_owner}"
    return attrs.evolve(run, lease_token=0, lease_expires_at=None), list(
        journal.transitions(run_id)
    )


def linear_spec(*phases: str, name: str = "linear") -> MachineSpec:
    """phase1 -NEXT-> phase2 ... -NEXT-> done; SYSTEM_ERROR from anywhere -> failed; USER_ABORTED -> canceled."""
    states = [State(phase, handler=phase) for phase in phases]
    states += [
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ]
    transitions = [
        Transition(phase, NEXT, nxt)
        for phase, nxt in zip(phases, [*phases[1:], "done"], strict=True)
    ]
    transitions += [
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ]
    return MachineSpec(name, states, transitions)


def path_of(journal, run_id):
    """(from_state, event, to_state) of every transition, seq order."""
    return [(t.from_state, t.event, t.to_state) for t in journal.transitions(run_id)]


def events_of(journal, run_id):
    return [t.event for t in journal.transitions(run_id)]


def noop(_ctx):
    return NEXT


def handlers_for(*names, **overrides):
    handlers = dict.fromkeys(names, noop)
    handlers.update(overrides)
    return handlers


def two_phase_engine(journal, **overrides):
    return Engine(
        linear_spec("a", "b"), handlers=handlers_for("a", "b", **overrides), journal=journal
    )


def no_exits_spec():
    """a -> b -> done with no SYSTEM_ERROR, TIMEOUT or USER_ABORTED transitions at all."""
    return MachineSpec(
        "bare",
        [State("a", handler="a"), State("b", handler="b"), State("done", terminal=True)],
        [Transition("a", NEXT, "b"), Transition("b", NEXT, "done")],
    )


def assert_all_json(journal, run_id):
    """Everything journaled for the run is plain JSON (what the SQLite journal can store)."""
    run = journal.load(run_id)
    json.dumps(run.context)
    json.dumps(run.error)
    json.dumps(run.input)
    for transition in journal.transitions(run_id):
        json.dumps(transition.result)


def approval_spec():
    """drafting -> awaiting_approval (no handler: waits for send) -> publishing -> published."""
    return MachineSpec(
        "approval",
        [
            State("drafting", handler="draft"),
            State("awaiting_approval"),
            State("publishing", handler="publish"),
            State("published", terminal=True),
            State("rejected", terminal=True, outcome="failed"),
            State("canceled", terminal=True, outcome="aborted"),
        ],
        [
            Transition("drafting", NEXT, "awaiting_approval"),
            Transition("awaiting_approval", "APPROVED", "publishing"),
            Transition("awaiting_approval", "REJECTED", "rejected"),
            Transition("publishing", NEXT, "published"),
            Transition("*", RunEvent.USER_ABORTED, "canceled"),
        ],
    )


def approval_engine(journal=None) -> Engine:
    """An engine of :func:`approval_spec` whose phases just move on (its own journal if none)."""
    return Engine(
        approval_spec(), handlers={"draft": lambda _: NEXT, "publish": lambda _: NEXT},
        journal=journal,
    )  # fmt: skip


def loop_spec() -> MachineSpec:
    """The 4-state loop used by the benchmark: a -> b -> c -> d -> a ... (never ends)."""
    names = ["a", "b", "c", "d"]
    return MachineSpec(
        "loop",
        [State(n, handler="noop") for n in names],
        [Transition(n, NEXT, m) for n, m in zip(names, names[1:] + names[:1], strict=True)],
    )


# The trigger as schema versions 1-3 wrote it (before it kept visit_seq).
TRIGGER_BEFORE_V4 = """CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions
WHEN NEW.seq > 0
BEGIN
    UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                    updated_at = NEW.at
     WHERE run_id = NEW.run_id AND seq = NEW.seq - 1;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE changes() = 0;
END"""


# The trigger as schema version 5 wrote it (before run heads were read from transitions).
TRIGGER_V5 = """CREATE TRIGGER transitions_advance_run AFTER INSERT ON transitions
WHEN NEW.seq > 0
BEGIN
    UPDATE runs SET state = NEW.to_state, seq = NEW.seq, iteration = NEW.iteration,
                    updated_at = NEW.at,
                    visit_seq = CASE WHEN NEW.from_state IS NEW.to_state
                                       AND NEW.event IN ('RETRIED', 'INTERRUPTED')
                                     THEN visit_seq ELSE NEW.seq END
     WHERE run_id = NEW.run_id AND seq = NEW.seq - 1 AND lease_token = NEW.lease_token;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE changes() = 0;
END"""


# The trigger as schema version 4 wrote it (before it checked lease tokens).
TRIGGER_V4 = TRIGGER_V5.replace(" AND lease_token = NEW.lease_token", "")
assert TRIGGER_V4 != TRIGGER_V5


# The two tables, the trigger and the view as schema version 6 wrote them (before run keys).
RUN_ROWS_V6 = """CREATE TABLE "run_rows_v6" (
   "run_id" TEXT PRIMARY KEY,
   "machine" TEXT NOT NULL,
   "spec_hash" TEXT NOT NULL REFERENCES "specs"("spec_hash"),
   "state" TEXT NOT NULL,
   "status" TEXT NOT NULL,
   "seq" INTEGER NOT NULL,
   "iteration" INTEGER DEFAULT 0,
   "attempt" INTEGER DEFAULT 1,
   "input" TEXT,
   "context" TEXT,
   "error" TEXT,
   "created_at" TEXT NOT NULL,
   "updated_at" TEXT,
   "parent_run_id" TEXT,
   "forked_from" TEXT,
   "abort_reason" TEXT,
   "lease_owner" TEXT,
   "lease_expires_at" TEXT,
   "lease_token" INTEGER DEFAULT 0
, "return_to" TEXT, "return_attempt" INTEGER NOT NULL DEFAULT 0, "visit_seq" INTEGER NOT NULL DEFAULT 0, "return_visit" INTEGER NOT NULL DEFAULT 0, "recoveries" INTEGER NOT NULL DEFAULT 0)"""
TRANSITIONS_V6 = """CREATE TABLE "transitions_v6" (
   "run_id" TEXT REFERENCES "run_rows"("run_id"),
   "seq" INTEGER,
   "from_state" TEXT,
   "event" TEXT NOT NULL,
   "to_state" TEXT NOT NULL,
   "iteration" INTEGER,
   "attempt" INTEGER,
   "at" TEXT NOT NULL,
   "duration_ms" REAL,
   "result" TEXT, "lease_token" INTEGER NOT NULL DEFAULT 0,
   PRIMARY KEY ("run_id", "seq")
)"""
TRIGGER_V6 = """CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
BEGIN
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE NOT EXISTS (SELECT 1 FROM run_rows
                        WHERE run_id = NEW.run_id AND lease_token = NEW.lease_token)
        OR NOT EXISTS (SELECT 1 FROM transitions
                        WHERE run_id = NEW.run_id AND seq = NEW.seq - 1);
END"""
VIEW_V6 = """CREATE VIEW runs AS
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
   AND t.seq = (SELECT max(m.seq) FROM transitions AS m WHERE m.run_id = r.run_id)"""
RUN_COLUMNS_V6 = (
    "run_id, machine, spec_hash, state, status, seq, iteration, attempt, input, context, error,"
    " created_at, updated_at, parent_run_id, forked_from, abort_reason, lease_owner,"
    " lease_expires_at, lease_token, return_to, return_attempt, visit_seq, return_visit,"
    " recoveries"
)
TRANSITION_COLUMNS_V6 = (
    "run_id, seq, from_state, event, to_state, iteration, attempt, at, duration_ms, result,"
    " lease_token"
)


TRIGGER_V7 = """CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
BEGIN
    SELECT RAISE(ABORT, 'fsm_runner: a transition needs the run_key of its run (SELECT run_key FROM run_rows WHERE run_id = ...)')
     WHERE NEW.run_key IS NULL;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE NOT EXISTS (SELECT 1 FROM run_rows
                        WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                          AND lease_token = NEW.lease_token)
        OR NOT EXISTS (SELECT 1 FROM transitions
                        WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
END"""


# The run rows, indexes and fence as schema version 8 wrote them (before version 9's claims and
# prune by index, and run keys without AUTOINCREMENT; version 9 left transitions as they were).
RUN_ROWS_V8 = """CREATE TABLE run_rows_v8 (
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
, abort_token INTEGER)"""
INDEXES_V8 = (
    'CREATE INDEX "idx_runs_machine_created_at" ON "run_rows" ("machine", "created_at")',
    'CREATE INDEX "idx_runs_status_created_at" ON "run_rows" ("status", "created_at")',
    'CREATE INDEX "idx_runs_created_at" ON "run_rows" ("created_at")',
    'CREATE INDEX "idx_runs_parent_run_id" ON "run_rows" ("parent_run_id")',
    'CREATE INDEX "idx_runs_status_lease_expires_at" ON "run_rows" ("status", "lease_expires_at")',
    'CREATE INDEX "idx_runs_status_machine_created_at"'
    ' ON "run_rows" ("status", "machine", "created_at")',
)
TRIGGER_V8 = """CREATE TRIGGER transitions_fence BEFORE INSERT ON transitions WHEN NEW.seq > 0
BEGIN
    SELECT RAISE(ABORT, 'fsm_runner: a transition needs the run_key of its run (SELECT run_key FROM run_rows WHERE run_id = ...)')
     WHERE NEW.run_key IS NULL;
    SELECT RAISE(ABORT, 'fsm_runner: the run is not at the seq before this transition')
     WHERE NOT EXISTS (SELECT 1 FROM run_rows
                        WHERE run_key = NEW.run_key AND run_id = NEW.run_id
                          AND lease_token = NEW.lease_token
                          AND (abort_token IS NULL OR abort_token < NEW.lease_token
                               OR NEW.event = 'USER_ABORTED'))
        OR NOT EXISTS (SELECT 1 FROM transitions
                        WHERE run_key = NEW.run_key AND seq = NEW.seq - 1);
END"""
RUN_COLUMNS_V8 = "run_key, " + RUN_COLUMNS_V6 + ", abort_token"


def undo_v12(conn) -> None:
    """Turn a journal's schema back from version 12 to 11: no outcomes index, no signal digests."""
    conn.execute("DROP INDEX idx_run_rows_outcomes")
    conn.execute("ALTER TABLE signals DROP COLUMN digest")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0012_outcomes'")
    conn.execute("UPDATE meta SET value = '11' WHERE key = 'schema_version'")


def undo_v11(conn) -> None:
    """Turn a journal's schema back from version 12 to 10: no digests."""
    undo_v12(conn)
    for table in ("transitions", "run_rows", "iterations", "effects", "artifacts"):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN digest")
    conn.execute("DELETE FROM meta WHERE key LIKE 'digests_%'")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0011_digests'")
    conn.execute("UPDATE meta SET value = '10' WHERE key = 'schema_version'")


def undo_v10(conn) -> None:
    """Turn a journal's schema back from version 11 to 9: no signals, no wake times."""
    undo_v11(conn)
    conn.execute("DROP TABLE signals")  # its indexes with it
    conn.execute("DROP INDEX idx_run_rows_due")
    conn.execute("DROP INDEX idx_run_rows_ready")  # version 10's names wake_at
    conn.execute("ALTER TABLE run_rows DROP COLUMN wake_at")
    conn.execute(
        "CREATE INDEX idx_run_rows_ready ON run_rows (machine, state)"
        " WHERE status = 'active' AND lease_owner IS NULL"
    )
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0010_waits'")
    conn.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")


def undo_v9(conn) -> None:
    """Turn a journal's schema back from version 10 to 8: run_rows and its indexes rebuilt."""
    from fsm_runner.journal._schema import _VIEW_V9  # version 7's view, unchanged since

    undo_v10(conn)
    conn.execute("DROP VIEW runs")
    conn.execute("DROP TRIGGER transitions_fence")
    conn.execute("DROP TRIGGER run_rows_released")
    conn.execute(RUN_ROWS_V8)
    conn.execute(
        f"INSERT INTO run_rows_v8 ({RUN_COLUMNS_V8}) SELECT {RUN_COLUMNS_V8} FROM run_rows"
        " ORDER BY run_key"
    )
    conn.execute("DROP TABLE run_rows")
    conn.execute("ALTER TABLE run_rows_v8 RENAME TO run_rows")
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'run_rows_v8'")
    conn.execute(
        "INSERT INTO sqlite_sequence (name, seq) SELECT 'run_rows', coalesce(max(run_key), 0)"
        " FROM run_rows WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'run_rows')"
    )
    for sql in INDEXES_V8:
        conn.execute(sql)
    conn.execute(TRIGGER_V8)
    conn.execute(_VIEW_V9)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0009_claims_prune_pages'")
    conn.execute("UPDATE meta SET value = '8' WHERE key = 'schema_version'")


def undo_v8(conn) -> None:
    """Turn a journal's schema back from version 10 to 7: a fence that ignores abort requests."""
    undo_v9(conn)
    conn.execute("DROP TRIGGER transitions_fence")
    conn.execute("ALTER TABLE run_rows DROP COLUMN abort_token")
    conn.execute(TRIGGER_V7)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0008_abort_fence'")
    conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")


def undo_v7(conn) -> None:
    """Turn a journal's schema back from version 10 to 6 (no integer run keys): tables rebuilt."""
    undo_v8(conn)
    conn.execute("DROP VIEW runs")
    conn.execute("DROP TRIGGER transitions_fence")
    indexes = [
        sql
        for (sql,) in conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'run_rows'"
            " AND sql IS NOT NULL"
        )
    ]
    conn.execute(RUN_ROWS_V6)
    conn.execute(
        f"INSERT INTO run_rows_v6 ({RUN_COLUMNS_V6}) SELECT {RUN_COLUMNS_V6} FROM run_rows"
        " ORDER BY run_key"
    )
    conn.execute(TRANSITIONS_V6)
    conn.execute(
        f"INSERT INTO transitions_v6 ({TRANSITION_COLUMNS_V6}) SELECT {TRANSITION_COLUMNS_V6}"
        " FROM transitions ORDER BY rowid"
    )
    conn.execute("DROP TABLE transitions")
    conn.execute("DROP TABLE run_rows")
    conn.execute("ALTER TABLE run_rows_v6 RENAME TO run_rows")
    conn.execute("ALTER TABLE transitions_v6 RENAME TO transitions")
    for sql in indexes:
        conn.execute(sql)
    conn.execute(TRIGGER_V6)
    conn.execute(VIEW_V6)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0007_run_keys'")
    conn.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


def undo_v6(conn) -> None:
    """Turn a journal's schema back from version 10 to 5 (run heads kept in the run rows)."""
    undo_v7(conn)
    heads = conn.execute(
        "SELECT run_id, state, seq, iteration, updated_at, visit_seq FROM runs"
    ).fetchall()
    conn.execute("DROP VIEW runs")
    conn.execute("DROP TRIGGER transitions_fence")
    conn.execute("ALTER TABLE run_rows RENAME TO runs")
    conn.executemany(
        "UPDATE runs SET state = ?, seq = ?, iteration = ?, updated_at = ?, visit_seq = ?"
        " WHERE run_id = ?",
        [(*head[1:], head[0]) for head in heads],
    )
    conn.execute(TRIGGER_V5)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0006_derived_heads'")
    conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")


def undo_v5(conn) -> None:
    """Turn a journal's schema back from version 10 to version 4 (no lease tokens, recoveries)."""
    undo_v6(conn)
    conn.execute("DROP TRIGGER transitions_advance_run")
    conn.execute("DROP INDEX IF EXISTS idx_runs_status_lease_expires_at")
    conn.execute("DROP INDEX IF EXISTS idx_runs_status_machine_created_at")
    conn.execute("ALTER TABLE transitions DROP COLUMN lease_token")
    conn.execute("ALTER TABLE runs DROP COLUMN recoveries")
    conn.execute(TRIGGER_V4)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0005_leases'")
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")


def undo_v4(conn) -> None:
    """Turn a journal's schema back from version 10 to version 3 (no effects, no visits)."""
    undo_v5(conn)
    conn.execute("DROP TRIGGER transitions_advance_run")
    for column in ("visit_seq", "return_visit"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("DROP TABLE effects")
    conn.execute(TRIGGER_BEFORE_V4)
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = 'm0004_effects'")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


def one_line_error(result, code: int = 1) -> str:
    """The one line a CLI error printed, checking its exit code and that nothing else came."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def start_release(journal_path, tmp_path, stop_after: int | None, version: str = "9.9.9") -> str:
    """A run of the release example in ``journal_path``, driven for ``stop_after`` phases."""
    from fsm_runner.examples import release

    engine = release.make_engine(journal_path)
    run_id = engine.start({"version": version, "workspace": str(tmp_path / "ws")})
    engine.run(run_id, max_steps=stop_after)
    engine.journal.close()
    return run_id


def nested_spec(*, extra_transitions=(), initial="", status_events=None, inner=None, **outer):
    """prepare -> working[a, inner[b, c], d] -> done; LOST anywhere in working -> recovering.

    recovering -FOUND-> RETURN (back to the sub-phase that was lost); SYSTEM_ERROR -> failed.
    """
    return MachineSpec(
        "nested",
        [
            State("prepare", handler="prepare"),
            State(
                "working",
                children=[
                    State("a", handler="a"),
                    State(
                        "inner",
                        children=[State("b", handler="b"), State("c", handler="c")],
                        **(inner or {}),
                    ),
                    State("d", handler="d"),
                ],
                **outer,
            ),
            State("recovering", handler="recover"),
            State("done", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            *extra_transitions,
            Transition("prepare", PHASE_COMPLETED, "working"),
            Transition("working", PHASE_COMPLETED, "done"),
            Transition("working", LOST, "recovering"),
            Transition("recovering", FOUND, RETURN),
            Transition("*", SYSTEM_ERROR, "failed"),
        ],
        initial=initial,
        status_events=status_events or {},
    )


def recorder(calls, name, result=PhaseStatus.OK):
    """A handler that records (name, attempt) and returns ``result`` (or result(call number))."""

    def handler(ctx):
        calls.append((name, ctx.attempt))
        count = sum(1 for called, _ in calls if called == name)
        return result(count) if callable(result) else result

    return handler


def nested_handlers(calls, **overrides):
    handlers = {name: recorder(calls, name) for name in ("prepare", "a", "b", "c", "d")}
    handlers["recover"] = recorder(calls, "recover", FOUND)
    handlers.update(overrides)
    return handlers


def iteration_loop_spec() -> MachineSpec:
    """building (starts an iteration) -> verifying -> feedback -> building ..., with a limit."""
    return MachineSpec(
        "loop",
        [
            State("building", handler="build", starts_iteration=True),
            State("verifying", handler="verify"),
            State("feedback", handler="feedback"),
            State("succeeded", terminal=True),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("building", "BUILT", "verifying"),
            Transition("verifying", RunEvent.VERIFY_PASSED, "succeeded"),
            Transition("verifying", RunEvent.VERIFY_FAILED_RETRYABLE, "feedback"),
            Transition(
                "feedback", "FEEDBACK_READY", "failed", unless=["iterations_left"],
                reason="iteration limit spent",
            ),
            Transition("feedback", "FEEDBACK_READY", "building"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )  # fmt: skip


class Counting:
    """A journal wrapper counting the calls made to it (by the engine), by name."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if callable(value):

            def counted(*args, **kwargs):
                self.calls.append(name)
                return value(*args, **kwargs)

            return counted
        return value


#: The SQLite tables whose rows name their run by ``run_id``.
_RUN_ID_TABLES = ("run_rows", "transitions", "iterations", "artifacts", "effects", "signals")


def rename_run(path, old: str, new: str) -> None:
    """Give run ``old`` of the SQLite journal at ``path`` the id ``new``, by raw SQL.

    What a journal written before the rule of run ids (or by another writer) may hold: the
    engine and the journals refuse such an id, so the tests that read one make it this way.
    Its children and forks are pointed at the new id too, and the digests of every row are
    computed again, as the journal that wrote such ids would have written them (the ids are
    the point here, not damage: ``check`` finds no digest that fails).
    """
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        for table in _RUN_ID_TABLES:
            db.execute(f"UPDATE {table} SET run_id = ? WHERE run_id = ?", (new, old))
        db.execute("UPDATE run_rows SET parent_run_id = ? WHERE parent_run_id = ?", (new, old))
        db.execute(
            "UPDATE run_rows SET forked_from = ? || substr(forked_from, ?)"
            " WHERE substr(forked_from, 1, ?) = ?",
            (new, len(old) + 1, len(old) + 1, old + "@"),
        )
        fill_digests(db)


#: Each older SQLite schema version, made from a journal of this one: the undo_v* steps above,
#: by the version they leave it at (each undoes the migrations above it, in turn).
UNDO_TO_VERSION = {
    3: undo_v4, 4: undo_v5, 5: undo_v6, 6: undo_v7, 7: undo_v8, 8: undo_v9, 9: undo_v10,
    10: undo_v11, 11: undo_v12,
}  # fmt: skip


def list_pages_both_ways(journal, middle: str, *, state: str, machine: str) -> None:
    """The runs list's pages after and before run ``middle`` (older, newer), unfiltered and by
    ``state``, status and ``machine``, and the lists sorted by last update (the inspector sorts at
    most 10,000 matches: read by the filter's index, then sorted): 14 reads, for their plans."""
    for filters in ({}, {"state": state}, {"status": "active"}, {"machine": machine}):
        journal.runs(before=middle, limit=51, **filters)
        journal.runs(after=middle, limit=51, **filters)
        if filters:
            journal.runs(by_update=True, limit=51, **filters)
            journal.runs(by_update=True, before=middle, limit=51, **filters)
